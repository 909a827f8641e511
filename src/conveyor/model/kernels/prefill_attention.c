/*
 * Causal self-attention of a fresh prompt (no cached prefix), float32, GQA; head dims
 * 16, 32, 64 and 128 (each a copy compiled with its dimension fixed, so that a query's
 * accumulator fits in registers).
 *
 * One task per (KV head, block of QB query rows): the block's rows times the G query
 * heads sharing that KV head walk the keys up to the block's last row in chunks of KC.
 * Each K chunk is transposed once into a [D][KC] tile, so a query's KC scores are D
 * vector FMAs across keys (no horizontal sums), four queries sharing each tile load; the
 * chunk is folded into a running (online) softmax, and the chunk's V rows are added into
 * each query's accumulator, held in registers. K and V are read straight from the
 * packed QKV projection (row strides given), once per task.
 *
 *   q    row t, head h at q + t * q_stride + h * D       (t < L, h < Hq)
 *   k, v row t, head h at k + t * kv_stride + h * D      (h < Hkv)
 *   out  row t, head h at out + t * out_stride + h * D
 *
 * Query row t attends to keys 0..t. Compiled with the other kernels (-O3 -march=native
 * -ffast-math -fopenmp); masked scores are a large negative number, not -inf, because
 * fast-math assumes finite values.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QB 16
#define KC 16
#define NEG (-1e30f)

/* A task's queries i = (row r0 + i / G, head h * G + i % G) copied pre-scaled into qs
 * (padded with zeros to nq4, a multiple of 4), its softmax state and accumulators reset.
 * Shared by both bodies; inlined with their fixed head dim. */
static inline void start_task(const float* restrict q, float* restrict qs, float* m, float* l,
                              float* acc, int nq, int nq4, int r0, int G, int h, int q_stride,
                              int dim, float scale) {
    for (int i = 0; i < nq4; i++) {
        float* dst = qs + (int64_t)i * dim;
        if (i < nq) {
            const float* src = q + (int64_t)(r0 + i / G) * q_stride
                             + (int64_t)(h * G + i % G) * dim;
            for (int d = 0; d < dim; d++) dst[d] = src[d] * scale;
        } else {
            for (int d = 0; d < dim; d++) dst[d] = 0.f;
        }
        m[i] = NEG;
        l[i] = 0.f;
    }
    memset(acc, 0, sizeof(float) * (size_t)nq4 * dim);
}

/* A task's outputs: each query's accumulator over its softmax denominator. */
static inline void finish_task(float* restrict out, const float* restrict acc, const float* l,
                               int nq, int r0, int G, int h, int out_stride, int dim) {
    for (int i = 0; i < nq; i++) {
        float* o = out + (int64_t)(r0 + i / G) * out_stride + (int64_t)(h * G + i % G) * dim;
        const float inv = 1.f / l[i];
        const float* ai = acc + (int64_t)i * dim;
        for (int d = 0; d < dim; d++) o[d] = ai[d] * inv;
    }
}

/* Register-blocked intrinsics where the CPU has them, else portable C the compiler
 * vectorizes (KC = 16 is two ymm registers of keys in both). */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "simd_math.h"
#define BODY "prefill_attention_avx2.h"
#else
#define BODY "prefill_attention_body.h"
#endif

#define D 16
#define NAME prefill_d16
#include BODY
#undef D
#undef NAME
#define D 32
#define NAME prefill_d32
#include BODY
#undef D
#undef NAME
#define D 64
#define NAME prefill_d64
#include BODY
#undef D
#undef NAME
#define D 128
#define NAME prefill_d128
#include BODY
#undef D
#undef NAME

/* Returns 0, or -1 for a head dim without a compiled copy (the caller falls back). */
int prefill_attention_f32(const float* q, const float* k, const float* v, float* out, int L,
                          int Hq, int Hkv, int head_dim, int q_stride, int kv_stride,
                          int out_stride, float scale) {
    switch (head_dim) {
        case 16: prefill_d16(q, k, v, out, L, Hq, Hkv, q_stride, kv_stride, out_stride, scale); return 0;
        case 32: prefill_d32(q, k, v, out, L, Hq, Hkv, q_stride, kv_stride, out_stride, scale); return 0;
        case 64: prefill_d64(q, k, v, out, L, Hq, Hkv, q_stride, kv_stride, out_stride, scale); return 0;
        case 128: prefill_d128(q, k, v, out, L, Hq, Hkv, q_stride, kv_stride, out_stride, scale); return 0;
        default: return -1;
    }
}
