/*
 * Decode attention over a paged KV cache, one query token per sequence.
 *
 * Each (sequence, KV head) pair is one task: it walks the sequence's context slots once,
 * scoring every K row against the G query heads of its group, then once more summing
 * V rows with the softmax weights. K and V bytes are read once each, straight from the
 * cache; nothing is gathered or padded.
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

#define DEFINE_DECODE(NAME, T, LOAD)                                                        \
void NAME(const float* q, const T* kc, const T* vc, const int64_t* slots,                   \
          const int32_t* lens, const int32_t* starts, float* out, int B, int Hq, int Hkv,   \
          int D, int L, float scale) {                                                      \
    const int G = Hq / Hkv;                                                                 \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1)")                            \
    for (int b = 0; b < B; b++) {                                                           \
        for (int h = 0; h < Hkv; h++) {                                                     \
            const int len = lens[b], start = starts[b], n = len - start;                    \
            const float* qh = q + ((int64_t)b * Hq + (int64_t)h * G) * D;                   \
            float* oh = out + ((int64_t)b * Hq + (int64_t)h * G) * D;                       \
            float* s = (float*)malloc(sizeof(float) * (size_t)G * (size_t)(n > 0 ? n : 1)); \
            float* row = (float*)malloc(sizeof(float) * (size_t)D);                         \
            float mx[64], sum[64];                                                          \
            for (int g = 0; g < G; g++) { mx[g] = -INFINITY; sum[g] = 0.f; }                \
            for (int t = 0; t < n; t++) {                                                   \
                const T* kr = kc + (slots[(int64_t)b * L + start + t] * Hkv + h) * D;       \
                for (int d = 0; d < D; d++) row[d] = LOAD(kr[d]);                           \
                for (int g = 0; g < G; g++) {                                               \
                    const float* qg = qh + (int64_t)g * D;                                  \
                    float acc = 0.f;                                                        \
                    for (int d = 0; d < D; d++) acc += qg[d] * row[d];                      \
                    acc *= scale;                                                           \
                    s[(int64_t)g * n + t] = acc;                                            \
                    if (acc > mx[g]) mx[g] = acc;                                           \
                }                                                                           \
            }                                                                               \
            for (int g = 0; g < G; g++) {                                                   \
                float* sg = s + (int64_t)g * n;                                             \
                float m = mx[g], acc = 0.f;                                                 \
                for (int t = 0; t < n; t++) { sg[t] = expf(sg[t] - m); acc += sg[t]; }      \
                sum[g] = acc;                                                               \
                memset(oh + (int64_t)g * D, 0, sizeof(float) * (size_t)D);                  \
            }                                                                               \
            for (int t = 0; t < n; t++) {                                                   \
                const T* vr = vc + (slots[(int64_t)b * L + start + t] * Hkv + h) * D;       \
                for (int d = 0; d < D; d++) row[d] = LOAD(vr[d]);                           \
                for (int g = 0; g < G; g++) {                                               \
                    const float p = s[(int64_t)g * n + t];                                  \
                    float* og = oh + (int64_t)g * D;                                        \
                    for (int d = 0; d < D; d++) og[d] += p * row[d];                        \
                }                                                                           \
            }                                                                               \
            for (int g = 0; g < G; g++) {                                                   \
                const float inv = sum[g] > 0.f ? 1.f / sum[g] : 0.f;                        \
                float* og = oh + (int64_t)g * D;                                            \
                for (int d = 0; d < D; d++) og[d] *= inv;                                   \
            }                                                                               \
            free(row);                                                                      \
            free(s);                                                                        \
        }                                                                                   \
    }                                                                                       \
}

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_float(x)

DEFINE_DECODE(decode_attention_f32, float, LOAD_F32)
DEFINE_DECODE(decode_attention_bf16, uint16_t, LOAD_BF16)

int max_group_size(void) { return 64; }
