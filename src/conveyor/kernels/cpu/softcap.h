/*
 * Attention logit soft-capping (Gemma 2's attn_logit_softcapping): a scaled score s
 * becomes cap * tanh(s / cap) before the mask and the softmax. Shared by the decode and
 * prefill attention kernels; a plain C loop that GCC vectorizes (expf through libmvec
 * under -ffast-math -fopenmp, the select as a blend), so every ISA build runs the same
 * formula. tanh_approx is shared with elementwise.c's GELU-tanh.
 *
 * tanh(y): for |y| < 0.625 an odd polynomial y P(y^2) (coefficients fitted for relative
 * error, within ~1.2 ulp of float64 tanh in float32 arithmetic), where 1 - 2/(e^2|y| + 1)
 * would lose bits to cancellation; else 1 - 2/(e^2|y| + 1) with |y| clamped at 40 (past
 * ~9.1 tanh rounds to exactly 1 in float32, as it must for GELU's 1 + tanh; the clamp
 * keeps e^2|y| finite: fast-math assumes no inf).
 */
#ifndef CONVEYOR_SOFTCAP_H
#define CONVEYOR_SOFTCAP_H
#include <math.h>
#include <stdint.h>

/* tanh(y) as above; inlined into loops that GCC vectorizes. */
static inline float tanh_approx(float y) {
    const float u = y * y, a = fminf(fabsf(y), 40.f);
    const float p = y * (1.f + u * (-0.3333326280117035f + u * (0.13331185281276703f
                    + u * (-0.0537252314388752f + u * (0.02060314640402794f
                    + u * -0.005672421306371689f)))));
    const float t = copysignf(1.f - 2.f / (expf(2.f * a) + 1.f), y);
    return a < 0.625f ? p : t;
}

static inline void softcap_scores(float* restrict s, int64_t n, float cap) {
    const float inv = 1.f / cap;
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) s[i] = cap * tanh_approx(s[i] * inv);
}
#endif
