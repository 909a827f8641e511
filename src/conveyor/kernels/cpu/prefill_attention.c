/*
 * Causal self-attention of a fresh prompt (no cached prefix), GQA; float32 or bfloat16
 * tensors (bf16 is converted where the query block and the K/V tiles are copied, and
 * rounded once on the way out, so the arithmetic is float32 in both; the AVX-512 BF16
 * body also rounds the softmax numerators for P @ V, see its header); head dims 16, 32,
 * 64, 128 and 256 (each a copy compiled with its dimension fixed, so that a query's
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
 * Query row t attends to keys 0..t. The _capped entries take Gemma 2's logit cap: a scaled
 * score s becomes softcap * tanh(s / softcap) before the mask (softcap.h; 0: none). Compiled with the other kernels (-O3 -march=native
 * -ffast-math -fopenmp); masked scores are a large negative number, not -inf, because
 * fast-math assumes finite values.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "softcap.h"

#define QB 16
#define KC 16
#define NEG (-1e30f)
/* How far a score may pass its query's reference max before the max moves (the AVX-512
 * and AVX2 bodies; the AMX body has its own): the softmax weights stay within e^8, and
 * a chunk that moves no max skips the max, the rescale factors and the rescale. */
#define SLACK 8.f

/* A task's queries i = (row r0 + i / G, head h * G + i % G) copied pre-scaled into qs
 * (padded with zeros to nq4, a multiple of 4; not when qs is NULL: a body that reads them
 * in another form), its softmax state and accumulators reset;
 * and its outputs, each query's accumulator over its softmax denominator. One copy per
 * element type (float32, bfloat16: converted here, so the hot loops only see float32),
 * shared by every body and inlined with its fixed head dim. */
#define DEFINE_TASK_IO(SUF, T, LOAD, STORE)                                                 \
static inline void start_task_##SUF(const T* restrict q, float* restrict qs, float* m,      \
                                    float* l, float* acc, int nq, int nq4, int r0, int G,   \
                                    int h, int q_stride, int dim, float scale) {            \
    /* Every line of the task's queries requested first, then copied: row by row, the copy \
     * waited on each row's lines in turn (7% of a mix's attention on a Zen 4). */          \
    for (int i = 0; i < nq; i++) {                                                          \
        const char* src = (const char*)(q + (int64_t)(r0 + i / G) * q_stride                \
                                        + (int64_t)(h * G + i % G) * dim);                  \
        for (int b = 0; b < dim * (int)sizeof(T); b += 64) __builtin_prefetch(src + b);     \
    }                                                                                       \
    for (int i = 0; i < nq4; i++) {                                                         \
        float* dst = qs == NULL ? NULL : qs + (int64_t)i * dim;                             \
        if (dst != NULL && i < nq) {                                                        \
            const T* src = q + (int64_t)(r0 + i / G) * q_stride                             \
                         + (int64_t)(h * G + i % G) * dim;                                  \
            for (int d = 0; d < dim; d++) dst[d] = LOAD(src[d]) * scale;                    \
        } else if (dst != NULL) {                                                           \
            for (int d = 0; d < dim; d++) dst[d] = 0.f;                                     \
        }                                                                                   \
        m[i] = NEG;                                                                         \
        l[i] = 0.f;                                                                         \
    }                                                                                       \
    memset(acc, 0, sizeof(float) * (size_t)nq4 * dim);                                      \
}                                                                                           \
static inline void finish_task_##SUF(T* restrict out, const float* restrict acc,            \
                                     const float* l, int nq, int r0, int G, int h,          \
                                     int out_stride, int dim) {                             \
    for (int i = 0; i < nq; i++) {                                                          \
        T* o = out + (int64_t)(r0 + i / G) * out_stride + (int64_t)(h * G + i % G) * dim;   \
        const float inv = 1.f / l[i];                                                       \
        const float* ai = acc + (int64_t)i * dim;                                           \
        for (int d = 0; d < dim; d++) o[d] = STORE(ai[d] * inv);                            \
    }                                                                                       \
}                                                                                           \
/* KV head h's keys j0 .. j0 + kn - 1 as a chunk of KC: K transposed into kt [dim][KC] (the  \
 * last key repeated as padding), V copied into vt [KC][dim] (zeros as padding). */          \
static inline void tile_chunk_##SUF(const T* restrict k, const T* restrict v,               \
                                    float* restrict kt, float* restrict vt, int j0, int kn, \
                                    int h, int kv_stride, int dim) {                        \
    for (int jj = 0; jj < KC; jj++) {                                                       \
        const int64_t off = (int64_t)(j0 + (jj < kn ? jj : kn - 1)) * kv_stride             \
                          + (int64_t)h * dim;                                               \
        if (kt) for (int d = 0; d < dim; d++) kt[d * KC + jj] = LOAD(k[off + d]);           \
        for (int d = 0; d < dim; d++) vt[jj * dim + d] = jj < kn ? LOAD(v[off + d]) : 0.f;  \
    }                                                                                       \
}

#define F32_ID(x) (x)
DEFINE_TASK_IO(f32, float, F32_ID, F32_ID)
DEFINE_TASK_IO(bf16, uint16_t, bf16_to_f32, f32_to_bf16)

/* Register-blocked intrinsics where the CPU has them (AVX-512F, else AVX2 + FMA), else
 * portable C the compiler vectorizes. -march=native picks one at build time, and the
 * build is cached per CPU (kernels/__init__.py), so each machine runs its own. */
#if defined(__AVX512F__)
#include <immintrin.h>

#include "simd_math.h"
#define BODY "prefill_attention_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "simd_math.h"
#define BODY "prefill_attention_avx2.h"
#else
#define BODY "prefill_attention_body.h"
#endif

/* Each body once per (element type, head dim): TIN for q, k, v and out, LOAD converts an
 * element to float32, SUF names the copies (prefill_<SUF>_d<D>), and the task I/O and
 * K/V tiles above come in the type's own version. */
#define TIN float
#define SUF f32
#define LOAD F32_ID
#define START_TASK start_task_f32
#define FINISH_TASK finish_task_f32
#define TILE_CHUNK tile_chunk_f32
#include "prefill_attention_dims.h"
#undef TIN
#undef SUF
#undef LOAD
#undef START_TASK
#undef FINISH_TASK
#undef TILE_CHUNK

#define TIN uint16_t
#define TIN_IS_BF16
#define SUF bf16
#define LOAD bf16_to_f32
#define START_TASK start_task_bf16
#define FINISH_TASK finish_task_bf16
#define TILE_CHUNK tile_chunk_bf16
#include "prefill_attention_dims.h"
#undef TIN
#undef TIN_IS_BF16
#undef SUF
#undef LOAD
#undef START_TASK
#undef FINISH_TASK
#undef TILE_CHUNK

/* The AMX body (prefill_attention_amx.c): 0 where it ran, -1 where the build or the OS
 * has no AMX tiles or the head dim does not suit it. */
int prefill_attention_bf16_amx(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                               uint16_t* out, int L, int Hq, int Hkv, int D, int q_stride,
                               int kv_stride, int out_stride, float scale);
#define NO_AMX_(...) (-1)

/* Returns 0, or -1 for a head dim without a compiled copy (the caller falls back). AMX,
 * where the build has it, takes bf16 before the vector bodies, uncapped only: the AMX body
 * keeps its scores in tiles and has no cap, so a capped call runs the AVX-512 body. */
#define DISPATCH(SUF, T, AMX)                                                               \
int prefill_attention_##SUF##_capped(const T* q, const T* k, const T* v, T* out, int L,     \
                                     int Hq, int Hkv, int head_dim, int q_stride,           \
                                     int kv_stride, int out_stride, float scale,            \
                                     float softcap) {                                       \
    if (!(softcap > 0.f) && AMX(q, k, v, out, L, Hq, Hkv, head_dim, q_stride, kv_stride,    \
                                out_stride, scale) == 0)                                    \
        return 0;                                                                           \
    switch (head_dim) {                                                                     \
        case 16: prefill_##SUF##_d16(q, k, v, out, L, Hq, Hkv, q_stride, kv_stride,         \
                                     out_stride, scale, softcap); return 0;                 \
        case 32: prefill_##SUF##_d32(q, k, v, out, L, Hq, Hkv, q_stride, kv_stride,         \
                                     out_stride, scale, softcap); return 0;                 \
        case 64: prefill_##SUF##_d64(q, k, v, out, L, Hq, Hkv, q_stride, kv_stride,         \
                                     out_stride, scale, softcap); return 0;                 \
        case 128: prefill_##SUF##_d128(q, k, v, out, L, Hq, Hkv, q_stride, kv_stride,       \
                                       out_stride, scale, softcap); return 0;               \
        case 256: prefill_##SUF##_d256(q, k, v, out, L, Hq, Hkv, q_stride, kv_stride,       \
                                       out_stride, scale, softcap); return 0;               \
        default: return -1;                                                                 \
    }                                                                                       \
}                                                                                           \
int prefill_attention_##SUF(const T* q, const T* k, const T* v, T* out, int L, int Hq,      \
                            int Hkv, int head_dim, int q_stride, int kv_stride,             \
                            int out_stride, float scale) {                                  \
    return prefill_attention_##SUF##_capped(q, k, v, out, L, Hq, Hkv, head_dim, q_stride,   \
                                            kv_stride, out_stride, scale, 0.f);             \
}
DISPATCH(f32, float, NO_AMX_)
DISPATCH(bf16, uint16_t, prefill_attention_bf16_amx)

/*
 * The fresh prompts of one step in one call (a layer's prefill attention in one call,
 * not one a prompt): segment s is rows starts[s] .. starts[s] + lens[s] - 1 of q, k, v
 * and out. A prompt whose causal work (L^2) is more than 1 / (2 x threads) of what is
 * left runs alone on every thread, longest first; the rest run one prompt to a thread,
 * longest first, in one parallel region (each body's own region is inactive inside it),
 * which saves a fork and join and the idle tail of each prompt's last tasks. A prompt's
 * tasks are the same either way, so the output does not depend on the split. Returns 0,
 * or -1 (nothing written) for a head dim without a compiled copy. The caller checks that
 * each segment lies inside the rows.
 */
#define DISPATCH_VARLEN(SUF, T)                                                             \
int prefill_attention_varlen_##SUF##_capped(const T* q, const T* k, const T* v, T* out,     \
                                            const int32_t* starts, const int32_t* lens,     \
                                            int nseg, int Hq, int Hkv, int head_dim,        \
                                            int q_stride, int kv_stride, int out_stride,    \
                                            float scale, float softcap) {                   \
    if (head_dim != 16 && head_dim != 32 && head_dim != 64 && head_dim != 128               \
        && head_dim != 256)                                                                 \
        return -1;                                                                          \
    if (nseg <= 0) return 0;                                                                \
    int* order = (int*)malloc(sizeof(int) * (size_t)nseg);                                  \
    if (order == NULL) return -1;                                                           \
    double left = 0.;                                                                       \
    for (int s = 0; s < nseg; s++) { /* longest first (insertion sort: a step's few) */     \
        int j = s;                                                                          \
        for (; j > 0 && lens[order[j - 1]] < lens[s]; j--) order[j] = order[j - 1];         \
        order[j] = s;                                                                       \
        left += (double)lens[s] * lens[s];                                                  \
    }                                                                                       \
    const int threads = omp_get_max_threads();                                              \
    int first = 0;                                                                          \
    for (; first < nseg; first++) {                                                         \
        const int s = order[first];                                                         \
        const double work = (double)lens[s] * lens[s];                                      \
        if (threads > 1 && work * 2 * threads <= left) break;                               \
        prefill_attention_##SUF##_capped(                                                   \
            q + (int64_t)starts[s] * q_stride, k + (int64_t)starts[s] * kv_stride,          \
            v + (int64_t)starts[s] * kv_stride, out + (int64_t)starts[s] * out_stride,      \
            lens[s], Hq, Hkv, head_dim, q_stride, kv_stride, out_stride, scale, softcap);   \
        left -= work;                                                                       \
    }                                                                                       \
    _Pragma("omp parallel for schedule(dynamic, 1)")                                        \
    for (int i = first; i < nseg; i++) {                                                    \
        const int s = order[i];                                                             \
        prefill_attention_##SUF##_capped(                                                   \
            q + (int64_t)starts[s] * q_stride, k + (int64_t)starts[s] * kv_stride,          \
            v + (int64_t)starts[s] * kv_stride, out + (int64_t)starts[s] * out_stride,      \
            lens[s], Hq, Hkv, head_dim, q_stride, kv_stride, out_stride, scale, softcap);   \
    }                                                                                       \
    free(order);                                                                            \
    return 0;                                                                               \
}                                                                                           \
int prefill_attention_varlen_##SUF(const T* q, const T* k, const T* v, T* out,              \
                                   const int32_t* starts, const int32_t* lens, int nseg,    \
                                   int Hq, int Hkv, int head_dim, int q_stride,             \
                                   int kv_stride, int out_stride, float scale) {            \
    return prefill_attention_varlen_##SUF##_capped(q, k, v, out, starts, lens, nseg, Hq,    \
                                                   Hkv, head_dim, q_stride, kv_stride,      \
                                                   out_stride, scale, 0.f);                 \
}
DISPATCH_VARLEN(f32, float)
DISPATCH_VARLEN(bf16, uint16_t)
