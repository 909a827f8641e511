/*
 * Decode attention over a paged KV cache, one query token per sequence.
 *
 * One task per sequence walks its context in chunks of CHUNK positions: it scores each
 * position's K row (all KV heads at once: one contiguous slot row) against every query
 * head, folds the chunk into a running (online) softmax, then adds the chunk's V rows
 * with those weights. K and V bytes are read once each, straight from the cache, a chunk
 * at a time, so each V row is read while its slot is still warm; the next chunk's rows
 * are prefetched while this one is computed (paged blocks sit anywhere in memory, where
 * the hardware prefetcher cannot follow: prefetching halved the kernel's time).
 *
 *   q        [B, Hq, D]           float32
 *   k, v     [num_slots, Hkv, D]  float32, or bfloat16 (uint16 bits) for the _bf16 entry
 *   slots    [B, L]               int64, context slot of each position (padded rows unused)
 *   lens     [B]                  int32, context length of each sequence (<= L)
 *   starts   [B]                  int32, first position attended (sliding window), usually 0
 *   out      [B, Hq, D]           float32
 *
 * Compiled at run time by conveyor/model/kernels/__init__.py with -O3 -march=native
 * -ffast-math -fopenmp; the fast-math licence only lets the compiler vectorize the dot
 * products, the exponentials and the sums.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = ((uint32_t)x) << 16;
    return v.f;
}

#define CHUNK 16

#define DEFINE_DECODE(NAME, T, LOAD)                                                        \
void NAME(const float* q, const T* kc, const T* vc, const int64_t* slots,                   \
          const int32_t* lens, const int32_t* starts, float* out, int B, int Hq, int Hkv,   \
          int D, int L, float scale) {                                                      \
    const int G = Hq / Hkv;                                                                 \
    _Pragma("omp parallel")                                                                 \
    {                                                                                       \
    float* acc = (float*)malloc(sizeof(float) * (size_t)Hq * (size_t)D);                    \
    float* row = (float*)malloc(sizeof(float) * (size_t)D);                                 \
    float* s = (float*)malloc(sizeof(float) * (size_t)Hq * CHUNK);                          \
    float* m = (float*)malloc(sizeof(float) * (size_t)Hq);                                  \
    float* l = (float*)malloc(sizeof(float) * (size_t)Hq);                                  \
    _Pragma("omp for schedule(dynamic, 1)")                                                 \
    for (int b = 0; b < B; b++) {                                                           \
        const int start = starts[b], n = lens[b] - start;                                   \
        const float* qb = q + (int64_t)b * Hq * D;                                          \
        const int64_t* sl = slots + (int64_t)b * L + start;                                 \
        memset(acc, 0, sizeof(float) * (size_t)Hq * D);                                     \
        for (int i = 0; i < Hq; i++) { m[i] = -INFINITY; l[i] = 0.f; }                      \
        for (int t0 = 0; t0 < n; t0 += CHUNK) {                                             \
            const int tn = n - t0 < CHUNK ? n - t0 : CHUNK;                                 \
            for (int t = 0; t < tn; t++) {                                                  \
                if (t0 + CHUNK + t < n) {                                                   \
                    const char* pk = (const char*)(kc + sl[t0 + CHUNK + t] * Hkv * D);      \
                    const char* pv = (const char*)(vc + sl[t0 + CHUNK + t] * Hkv * D);      \
                    for (int o = 0; o < (int)(Hkv * D * sizeof(T)); o += 64) {              \
                        __builtin_prefetch(pk + o); __builtin_prefetch(pv + o); }           \
                }                                                                           \
                const T* kr = kc + sl[t0 + t] * Hkv * D;                                    \
                for (int h = 0; h < Hkv; h++) {                                             \
                    const T* kh = kr + (int64_t)h * D;                                      \
                    for (int g = 0; g < G; g++) {                                           \
                        const float* qg = qb + (int64_t)(h * G + g) * D;                    \
                        float a = 0.f;                                                      \
                        _Pragma("omp simd reduction(+:a)")                                  \
                        for (int d = 0; d < D; d++) a += qg[d] * LOAD(kh[d]);               \
                        s[(h * G + g) * CHUNK + t] = a * scale;                             \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
            for (int i = 0; i < Hq; i++) {                                                  \
                float* si = s + i * CHUNK;                                                  \
                float cm = m[i];                                                            \
                for (int t = 0; t < tn; t++) cm = si[t] > cm ? si[t] : cm;                  \
                if (cm > m[i]) {                                                            \
                    const float alpha = expf(m[i] - cm);                                    \
                    float* ai = acc + (int64_t)i * D;                                       \
                    for (int d = 0; d < D; d++) ai[d] *= alpha;                             \
                    l[i] *= alpha;                                                          \
                    m[i] = cm;                                                              \
                }                                                                           \
                float sum = 0.f;                                                            \
                for (int t = 0; t < tn; t++) { si[t] = expf(si[t] - cm); sum += si[t]; }    \
                l[i] += sum;                                                                \
            }                                                                               \
            for (int t = 0; t < tn; t++) {                                                  \
                const T* vr = vc + sl[t0 + t] * Hkv * D;                                    \
                for (int h = 0; h < Hkv; h++) {                                             \
                    const T* vh = vr + (int64_t)h * D;                                      \
                    for (int d = 0; d < D; d++) row[d] = LOAD(vh[d]);                       \
                    for (int g = 0; g < G; g++) {                                           \
                        const int i = h * G + g;                                            \
                        const float p = s[i * CHUNK + t];                                   \
                        float* ai = acc + (int64_t)i * D;                                   \
                        for (int d = 0; d < D; d++) ai[d] += p * row[d];                    \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        float* ob = out + (int64_t)b * Hq * D;                                              \
        for (int i = 0; i < Hq; i++) {                                                      \
            const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;                                \
            for (int d = 0; d < D; d++) ob[(int64_t)i * D + d] = acc[(int64_t)i * D + d] * inv; \
        }                                                                                   \
    }                                                                                       \
    free(acc); free(row); free(s); free(m); free(l);                                        \
    }                                                                                       \
}

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_float(x)

DEFINE_DECODE(decode_attention_f32, float, LOAD_F32)
DEFINE_DECODE(decode_attention_bf16, uint16_t, LOAD_BF16)
