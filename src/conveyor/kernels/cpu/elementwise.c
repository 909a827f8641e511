/*
 * Fused elementwise kernels for the decoder layer on CPU (float32).
 *
 * In eager PyTorch each of these is five to fifteen small ops, and at decode batch sizes
 * the per-op dispatch costs more than the arithmetic. Each function here is one pass
 * over its rows, parallel over rows with OpenMP, vectorized by the compiler.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"
#include "softcap.h"

/* Intrinsics where the CPU has AVX-512F or AVX2 + FMA (LANES: 16 or 8 float lanes), for
 * silu's exp (libmvec's expf through the compiler ran at ~1/3 of memory speed on the
 * MLP's 2,048 x 1,536: benchmarks/steps/prefill_step.py; exp512/exp256 are Cephes' polynomial,
 * within ~1 ulp) and for the bf16 kernels, whose scalar conversions and roundings the
 * compiler left scalar (2.0-2.2x the float32 kernels' time on 2,048 rows:
 * benchmarks/kernels/elementwise_kernels.py). */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

#include "simd_math.h"
#endif

/* The widest vectors the build has: V(op) is the intrinsic op at that width (V(_add_ps):
 * _mm512_add_ps or _mm256_add_ps), the V_ names what differs by more than the prefix. */
#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vf_t;
typedef __m512i vi_t;
#define V(op) CONVEYOR_CAT(_mm512, op)
#define V_EXP exp512
#define V_RCP _mm512_rcp14_ps /* 14 bits: one Newton step gives ~2^-28, about an ulp */
#define V_AND_SI _mm512_and_si512
#define V_CAST_PS_SI _mm512_castps_si512
#define V_CAST_SI_PS _mm512_castsi512_ps
#define V_LOAD_HALF(p) _mm256_loadu_si256((const __m256i*)(p)) /* 16 bf16 */
#define V_HSUM _mm512_reduce_add_ps
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8
typedef __m256 vf_t;
typedef __m256i vi_t;
#define V(op) CONVEYOR_CAT(_mm256, op)
#define V_EXP exp256
#define V_RCP _mm256_rcp_ps /* 12 bits: one Newton step gives ~2^-22, one or two ulps */
#define V_AND_SI _mm256_and_si256
#define V_CAST_PS_SI _mm256_castps_si256
#define V_CAST_SI_PS _mm256_castsi256_ps
#define V_LOAD_HALF(p) _mm_loadu_si128((const __m128i*)(p)) /* 8 bf16 */
#define V_HSUM hsum256
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#else
#define LANES 0
#endif

#if LANES
/* 1 / d by the reciprocal estimate and one Newton step: a vdivps is ~3x the rest of silu
 * on a Zen 5 */
static inline vf_t recip_v(vf_t d) {
    const vf_t r = V_RCP(d);
    return V(_mul_ps)(r, V(_fnmadd_ps)(d, r, V(_set1_ps)(2.f)));
}
/* g / (1 + e^-g), -g clamped at 80 as the scalar loop does */
static inline vf_t silu_v(vf_t g) {
    const vf_t e = V_EXP(V(_min_ps)(V(_sub_ps)(V(_setzero_ps)(), g), V(_set1_ps)(80.f)));
    return V(_mul_ps)(g, recip_v(V(_add_ps)(V(_set1_ps)(1.f), e)));
}
/* bf16.h's conversions, a vector at a time: widen by a shift, round to nearest even by
 * integer adds */
static inline vf_t vload_bf16(const uint16_t* p) {
    return V_CAST_SI_PS(V(_slli_epi32)(V(_cvtepu16_epi32)(V_LOAD_HALF(p)), 16));
}
static inline vi_t rne_bits(vf_t f) { /* the rounded value's top 16 bits, as int32 */
    const vi_t u = V_CAST_PS_SI(f);
    const vi_t odd = V_AND_SI(V(_srli_epi32)(u, 16), V(_set1_epi32)(1));
    return V(_srli_epi32)(V(_add_epi32)(V(_add_epi32)(u, V(_set1_epi32)(0x7FFF)), odd), 16);
}
#endif

/* Rounding a vector to bf16 and storing one: what each width has for it. */
#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
/* vcvtneps2bf16 rounds to nearest even too (it differs from the integer adds on NaN only) */
static inline __m256i bf16_bits(vf_t f) { return (__m256i)_mm512_cvtneps_pbh(f); }
#else
static inline __m256i bf16_bits(vf_t f) { return _mm512_cvtepi32_epi16(rne_bits(f)); }
#endif
static inline vf_t vround_bf16(vf_t f) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(f)), 16));
}
static inline void vstore_bf16(uint16_t* p, vf_t f) {
    _mm256_storeu_si256((__m256i*)p, bf16_bits(f));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline vf_t vround_bf16(vf_t f) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(rne_bits(f), 16));
}
static inline void vstore_bf16(uint16_t* p, vf_t f) {
    const __m256i b = rne_bits(f); /* each lane < 2^16: packus keeps it */
    _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(b),
                                                   _mm256_extracti128_si256(b, 1)));
}
#endif

/* out = rms_norm(x) * w  (rows of dim) */
void rms_norm_f32(const float* x, const float* w, float* out, int rows, int dim, float eps) {
    #pragma omp parallel for schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        const float* xr = x + (int64_t)r * dim;
        float* o = out + (int64_t)r * dim;
        float ss = 0.f;
        for (int i = 0; i < dim; i++) ss += xr[i] * xr[i];
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
        for (int i = 0; i < dim; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

/* residual += x; out = rms_norm(residual) * w  (the pre-norm residual stream) */
void add_rms_norm_f32(const float* x, float* residual, const float* w, float* out, int rows,
                      int dim, float eps) {
    #pragma omp parallel for schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        const float* xr = x + (int64_t)r * dim;
        float* res = residual + (int64_t)r * dim;
        float* o = out + (int64_t)r * dim;
        float ss = 0.f;
        for (int i = 0; i < dim; i++) {
            const float h = res[i] + xr[i];
            res[i] = h;
            ss += h * h;
        }
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
        for (int i = 0; i < dim; i++) o[i] = w[i] * (res[i] * inv);
    }
}

/* out[r, i] = silu(gu[r, i]) * gu[r, inter + i] */
void silu_mul_f32(const float* gu, float* out, int rows, int inter) {
    #pragma omp parallel for schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        const float* g = gu + (int64_t)r * 2 * inter;
        const float* u = g + inter;
        float* o = out + (int64_t)r * inter;
        int i = 0;
#if LANES
        for (; i + LANES <= inter; i += LANES)
            V(_storeu_ps)(o + i, V(_mul_ps)(silu_v(V(_loadu_ps)(g + i)), V(_loadu_ps)(u + i)));
#endif
        /* the clamp keeps expf finite, as -ffast-math assumes: silu(g < -80) ~ 0 */
        for (; i < inter; i++) o[i] = g[i] / (1.f + expf(fminf(-g[i], 80.f))) * u[i];
    }
}

/* out[r, i] = gelu_tanh(gu[r, i]) * gu[r, inter + i] (Gemma's GeGLU), gelu_tanh(g) =
 * 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) as torch's approximate="tanh" has it,
 * with softcap.h's tanh. */
void gelu_tanh_mul_f32(const float* gu, float* out, int rows, int inter) {
    #pragma omp parallel for schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        const float* g = gu + (int64_t)r * 2 * inter;
        const float* u = g + inter;
        float* o = out + (int64_t)r * inter;
        #pragma omp simd
        for (int i = 0; i < inter; i++) {
            const float x = g[i];
            const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
            o[i] = 0.5f * x * (1.f + tanh_approx(inner)) * u[i];
        }
    }
}

/* x[i] = cap * tanh(x[i] / cap) in place (Gemma 2's final logit soft-capping), in slices
 * over the threads. */
void softcap_f32(float* x, int64_t n, float cap) {
    const int64_t slice = 16384;
    #pragma omp parallel for schedule(static) if (n > 2 * slice)
    for (int64_t i = 0; i < n; i += slice) softcap_scores(x + i, n - i < slice ? n - i : slice, cap);
}

/*
 * Neox-style rotary embedding, in place on the first (Hq + Hkv) heads of each row of a
 * packed [T, (Hq + 2 Hkv) * D] QKV buffer. cos/sin: [max_pos, D] tables (halves equal).
 */
void rope_f32(float* qkv, const int64_t* pos, const float* cos_t, const float* sin_t, int T,
              int heads, int row_stride, int D) {
    const int half = D / 2;
    #pragma omp parallel for schedule(static) if (T > 8)
    for (int t = 0; t < T; t++) {
        const float* c = cos_t + pos[t] * D;
        const float* s = sin_t + pos[t] * D;
        for (int h = 0; h < heads; h++) {
            float* x = qkv + (int64_t)t * row_stride + (int64_t)h * D;
            for (int i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] - x2 * s[i];
                x[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
    }
}

/*
 * bfloat16 versions: bf16 in and out, fp32 arithmetic inside, rounded (to nearest even)
 * wherever the reference (TorchOps on bf16 tensors) rounds, so that they track it to
 * the rounding of a sum's order: RMSNorm rounds x / rms(x) before the weight multiplies,
 * the residual add rounds, silu rounds before the multiply by up, RoPE rounds the tables
 * and each product before the add. With LANES, whole vectors go through the intrinsics
 * above (the same roundings, a vector at a time) and a row's last dim % LANES elements
 * through the scalar conversions of bf16.h, which is all a build without them has.
 */

/* The norms' rows in intrinsics with AVX-512 only: capped at AVX2, the compiler's own
 * vectorization of the scalar loops measured level with them or faster (1.03-1.05x on
 * 2,048 rows: benchmarks/kernels/elementwise_kernels.py with CONVEYOR_KERNEL_ISA=avx2), where with
 * AVX-512 the intrinsics are 1.2-1.4x faster. */
#if defined(__AVX512F__)
#define NORM_LANES LANES
#else
#define NORM_LANES 0
#endif

/* The sum of squares of a row of n bf16 values (whole vectors, then the tail); two
 * vectors a step into two accumulators, so the FMAs' latency overlaps. */
static inline float sum_squares_bf16(const uint16_t* x, int n) {
    int i = 0;
    float ss = 0.f;
#if NORM_LANES
    vf_t acc0 = V(_setzero_ps)(), acc1 = V(_setzero_ps)();
    for (; i + 2 * LANES <= n; i += 2 * LANES) {
        const vf_t a = vload_bf16(x + i), b = vload_bf16(x + i + LANES);
        acc0 = V(_fmadd_ps)(a, a, acc0);
        acc1 = V(_fmadd_ps)(b, b, acc1);
    }
    for (; i + LANES <= n; i += LANES) {
        const vf_t a = vload_bf16(x + i);
        acc0 = V(_fmadd_ps)(a, a, acc0);
    }
    ss = V_HSUM(V(_add_ps)(acc0, acc1));
#endif
    for (; i < n; i++) {
        const float v = bf16_to_f32(x[i]);
        ss += v * v;
    }
    return ss;
}

/* o = w * bf16(x * inv), rounded, over a row of n: w read widened (wf) where the call
 * could widen it once, else from bf16 (w16) */
static inline void scale_row_bf16(const uint16_t* x, const uint16_t* w16, const float* wf,
                                  uint16_t* o, int n, float inv) {
    int i = 0;
#if NORM_LANES
    const vf_t vinv = V(_set1_ps)(inv);
    for (; i + LANES <= n; i += LANES) {
        const vf_t w = wf != NULL ? V(_loadu_ps)(wf + i) : vload_bf16(w16 + i);
        vstore_bf16(o + i, V(_mul_ps)(w, vround_bf16(V(_mul_ps)(vload_bf16(x + i), vinv))));
    }
#endif
    for (; i < n; i++)
        o[i] = f32_to_bf16(bf16_to_f32(w16[i]) * round_bf16(bf16_to_f32(x[i]) * inv));
}

/* The weight widened once a call (every row multiplies by it); NULL if there is no
 * memory for it (the rows then widen it themselves). */
static float* widen_bf16(const uint16_t* w, int n) {
    float* wf = (float*)malloc(sizeof(float) * (size_t)n);
    if (wf != NULL)
        for (int i = 0; i < n; i++) wf[i] = bf16_to_f32(w[i]);
    return wf;
}

void rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* out, int rows, int dim,
                   float eps) {
    float* wf = widen_bf16(w, dim);
    #pragma omp parallel for schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        const uint16_t* xr = x + (int64_t)r * dim;
        const float inv = 1.f / sqrtf(sum_squares_bf16(xr, dim) / (float)dim + eps);
        scale_row_bf16(xr, w, wf, out + (int64_t)r * dim, dim, inv);
    }
    free(wf);
}

void add_rms_norm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* w,
                       uint16_t* out, int rows, int dim, float eps) {
    float* wf = widen_bf16(w, dim);
    #pragma omp parallel for schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        const uint16_t* xr = x + (int64_t)r * dim;
        uint16_t* res = residual + (int64_t)r * dim;
        int i = 0;
        float ss = 0.f;
#if NORM_LANES
        /* the sum rounded once: stored as it is and squared as it is */
        vf_t acc0 = V(_setzero_ps)(), acc1 = V(_setzero_ps)();
        for (; i + 2 * LANES <= dim; i += 2 * LANES) {
            const vf_t a = vround_bf16(V(_add_ps)(vload_bf16(res + i), vload_bf16(xr + i)));
            const vf_t b = vround_bf16(V(_add_ps)(vload_bf16(res + i + LANES),
                                                  vload_bf16(xr + i + LANES)));
            vstore_bf16(res + i, a);
            vstore_bf16(res + i + LANES, b);
            acc0 = V(_fmadd_ps)(a, a, acc0);
            acc1 = V(_fmadd_ps)(b, b, acc1);
        }
        for (; i + LANES <= dim; i += LANES) {
            const vf_t a = vround_bf16(V(_add_ps)(vload_bf16(res + i), vload_bf16(xr + i)));
            vstore_bf16(res + i, a);
            acc0 = V(_fmadd_ps)(a, a, acc0);
        }
        ss = V_HSUM(V(_add_ps)(acc0, acc1));
#endif
        for (; i < dim; i++) {
            const uint16_t hb = f32_to_bf16(bf16_to_f32(res[i]) + bf16_to_f32(xr[i]));
            const float h = bf16_to_f32(hb);
            res[i] = hb;
            ss += h * h;
        }
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
        scale_row_bf16(res, w, wf, out + (int64_t)r * dim, dim, inv);
    }
    free(wf);
}

void silu_mul_bf16(const uint16_t* gu, uint16_t* out, int rows, int inter) {
    #pragma omp parallel for schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        const uint16_t* g = gu + (int64_t)r * 2 * inter;
        const uint16_t* u = g + inter;
        uint16_t* o = out + (int64_t)r * inter;
        int i = 0;
#if LANES
        for (; i + LANES <= inter; i += LANES)
            vstore_bf16(o + i, V(_mul_ps)(vround_bf16(silu_v(vload_bf16(g + i))),
                                          vload_bf16(u + i)));
#endif
        for (; i < inter; i++) {
            const float gv = bf16_to_f32(g[i]);
            const float s = round_bf16(gv / (1.f + expf(fminf(-gv, 80.f))));
            o[i] = f32_to_bf16(s * bf16_to_f32(u[i]));
        }
    }
}

/* RoPE on one bf16 head: x[i] = bf16(bf16(x1 c1) - bf16(x2 s1)), x[i + half] =
 * bf16(bf16(x2 c2) + bf16(x1 s2)), with c and s the row's tables already rounded to bf16
 * (round_bf16(-a) is -round_bf16(a): the reference's rotate_half negation commutes). */
static inline void rope_head_bf16(uint16_t* x, const float* c, const float* s, int half) {
    int i = 0;
#if LANES
    for (; i + LANES <= half; i += LANES) {
        const vf_t x1 = vload_bf16(x + i), x2 = vload_bf16(x + i + half);
        vstore_bf16(x + i, V(_sub_ps)(vround_bf16(V(_mul_ps)(x1, V(_loadu_ps)(c + i))),
                                      vround_bf16(V(_mul_ps)(x2, V(_loadu_ps)(s + i)))));
        vstore_bf16(x + i + half,
                    V(_add_ps)(vround_bf16(V(_mul_ps)(x2, V(_loadu_ps)(c + i + half))),
                               vround_bf16(V(_mul_ps)(x1, V(_loadu_ps)(s + i + half)))));
    }
#endif
    for (; i < half; i++) {
        const float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[i + half]);
        x[i] = f32_to_bf16(round_bf16(x1 * c[i]) - round_bf16(x2 * s[i]));
        x[i + half] = f32_to_bf16(round_bf16(x2 * c[i + half]) + round_bf16(x1 * s[i + half]));
    }
}

#define ROPE_MAX_D 512 /* head dims up to this round their tables once per row */

void rope_bf16(uint16_t* qkv, const int64_t* pos, const float* cos_t, const float* sin_t,
               int T, int heads, int row_stride, int D) {
    const int half = D / 2;
    #pragma omp parallel for schedule(static) if (T > 8)
    for (int t = 0; t < T; t++) {
        const float* c = cos_t + pos[t] * D;
        const float* s = sin_t + pos[t] * D;
        float cs[2 * ROPE_MAX_D];
        if (D <= ROPE_MAX_D) { /* the row's tables rounded to bf16 once, for all heads */
            for (int i = 0; i < D; i++) {
                cs[i] = round_bf16(c[i]);
                cs[ROPE_MAX_D + i] = round_bf16(s[i]);
            }
            for (int h = 0; h < heads; h++)
                rope_head_bf16(qkv + (int64_t)t * row_stride + (int64_t)h * D, cs,
                               cs + ROPE_MAX_D, half);
            continue;
        }
        for (int h = 0; h < heads; h++) {
            uint16_t* x = qkv + (int64_t)t * row_stride + (int64_t)h * D;
            for (int i = 0; i < half; i++) {
                const float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[i + half]);
                const float c1 = round_bf16(c[i]), s1 = round_bf16(s[i]);
                const float c2 = round_bf16(c[i + half]), s2 = round_bf16(s[i + half]);
                x[i] = f32_to_bf16(round_bf16(x1 * c1) + round_bf16(-x2 * s1));
                x[i + half] = f32_to_bf16(round_bf16(x2 * c2) + round_bf16(x1 * s2));
            }
        }
    }
}
