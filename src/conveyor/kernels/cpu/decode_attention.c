/*
 * Decode attention over a paged KV cache, one query token per sequence.
 *
 * One task per sequence (per segment of a long one, in the vector body: SEG_LEN) walks its
 * context in chunks of CHUNK positions: it scores each
 * position's K row (all KV heads at once: one contiguous slot row) against every query
 * head, folds the chunk into a running (online) softmax, then adds the chunk's V rows
 * with those weights. K and V bytes are read once each, straight from the cache, a chunk
 * at a time, so each V row is read while its slot is still warm; the next chunk's rows
 * are prefetched while this one is computed (paged blocks sit anywhere in memory, where
 * the hardware prefetcher cannot follow: prefetching halved the kernel's time).
 *
 *   q        [B, Hq, D]           float32
 *   k, v     [num_slots, Hkv, D]  float32, or bfloat16 (uint16 bits) for the _bf16 entry,
 *                                 or one-byte codes (kv_quant.h) for the _q8 entry, with
 *   ksc, vsc [num_slots, Hkv]     float32 scales (a value is its code times its scale)
 *   slots    [B, L]               int64, context slot of each position (padded rows unused)
 *   lens     [B]                  int32, context length of each sequence (<= L)
 *   starts   [B]                  int32, first position attended (sliding window), usually 0
 *   out      [B, Hq, D]           float32
 *   softcap  the _capped entries: a scaled score s becomes softcap * tanh(s / softcap)
 *            before the softmax (Gemma 2; softcap.h); 0 for none, as the other entries
 *
 * Compiled at run time by conveyor/kernels/cpu/__init__.py with -O3 -march=native
 * -ffast-math -fopenmp; the fast-math licence only lets the compiler vectorize the dot
 * products, the exponentials and the sums.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_quant.h"
#include "softcap.h"

static inline float bf16_to_float(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = ((uint32_t)x) << 16;
    return v.f;
}

#define CHUNK 16
/* The vector body prefetches K and V rows ahead into L2 (a sequence's first ones before
 * it starts), then the chunk's K rows into L1 as the chunk starts. Into L1 (48 KiB of
 * bf16 K and V ahead, more than L1 holds) the prefetched lines evicted each other. On a
 * 2-core Zen 4 (benchmarks/kernels/decode_attention_kernel.py, batch 32 x 260, out of cache):
 *   - a bf16 cache, whose chunk is widened in one run of loads at its start, prefetches
 *     PF_DIST_WIDE positions ahead as the chunk starts: 8 was 1.09-1.10x faster than 64
 *     (4 and 16 in between), and spreading its prefetches over P V was 6% slower;
 *   - an fp32 cache, read in place by the scores and P V, prefetches PF_DIST positions
 *     ahead from inside P V, each KV head's tile its own head's K and V lines of a
 *     position as it reaches it, so the loads go out among the arithmetic instead of in
 *     one burst before it: 1.21x faster than the burst (8 positions ahead 1.05x, 32
 *     1.13x). */
#define PF_DIST 16
#define PF_DIST_WIDE 8

/* Prefetch one position's K and V rows (bytes each: paged blocks sit anywhere in memory,
 * where the hardware prefetcher cannot follow), into L1 (the generic body) or L2. */
static inline void prefetch_kv(const void* k, const void* v, int bytes) {
    for (int o = 0; o < bytes; o += 64) {
        __builtin_prefetch((const char*)k + o);
        __builtin_prefetch((const char*)v + o);
    }
}
static inline void prefetch_kv_l2(const void* k, const void* v, int bytes) {
    for (int o = 0; o < bytes; o += 64) {
        __builtin_prefetch((const char*)k + o, 0, 2);
        __builtin_prefetch((const char*)v + o, 0, 2);
    }
}
static inline void prefetch_l1(const void* p, int bytes) {
    for (int o = 0; o < bytes; o += 64) __builtin_prefetch((const char*)p + o, 0, 3);
}

/* A sequence's output: each query head's accumulator over its softmax denominator. */
static inline void write_normalized(float* ob, const float* acc, const float* l, int Hq,
                                    int D) {
    for (int i = 0; i < Hq; i++) {
        const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
        for (int d = 0; d < D; d++) ob[(int64_t)i * D + d] = acc[(int64_t)i * D + d] * inv;
    }
}

/* KS(slot, h), VS(slot, h): a K or V head's scale (1 for a float cache); SETUP: what the
 * loads need, once a call. NAME takes PARAMS and the cap (0: none). */
#define DEFINE_DECODE(NAME, PARAMS, T, LOAD, KS, VS, SETUP)                                 \
void NAME(PARAMS, float softcap) {                                                          \
    const int G = Hq / Hkv;                                                                 \
    SETUP                                                                                   \
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
                if (t0 + CHUNK + t < n)                                                     \
                    prefetch_kv(kc + sl[t0 + CHUNK + t] * Hkv * D,                          \
                                vc + sl[t0 + CHUNK + t] * Hkv * D, (int)(Hkv * D * sizeof(T))); \
                const T* kr = kc + sl[t0 + t] * Hkv * D;                                    \
                for (int h = 0; h < Hkv; h++) {                                             \
                    const T* kh = kr + (int64_t)h * D;                                      \
                    for (int g = 0; g < G; g++) {                                           \
                        const float* qg = qb + (int64_t)(h * G + g) * D;                    \
                        float a = 0.f;                                                      \
                        _Pragma("omp simd reduction(+:a)")                                  \
                        for (int d = 0; d < D; d++) a += qg[d] * LOAD(kh[d]);               \
                        s[(h * G + g) * CHUNK + t] = a * scale * KS(sl[t0 + t], h);         \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
            for (int i = 0; i < Hq; i++) {                                                  \
                float* si = s + i * CHUNK;                                                  \
                if (softcap > 0.f) softcap_scores(si, tn, softcap);                         \
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
                    const float vs = VS(sl[t0 + t], h);                                     \
                    for (int d = 0; d < D; d++) row[d] = LOAD(vh[d]) * vs;                  \
                    for (int g = 0; g < G; g++) {                                           \
                        const int i = h * G + g;                                            \
                        const float p = s[i * CHUNK + t];                                   \
                        float* ai = acc + (int64_t)i * D;                                   \
                        for (int d = 0; d < D; d++) ai[d] += p * row[d];                    \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        write_normalized(out + (int64_t)b * Hq * D, acc, l, Hq, D);                         \
    }                                                                                       \
    free(acc); free(row); free(s); free(m); free(l);                                        \
    }                                                                                       \
}

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_float(x)
#define LOAD_Q8(x) lut[x]
#define UNSCALED(slot, h) 1.f
#define K_SCALE(slot, h) ksc[(slot) * Hkv + (h)]
#define V_SCALE(slot, h) vsc[(slot) * Hkv + (h)]
#define FLOAT_PARAMS(T) const float* q, const T* kc, const T* vc, const int64_t* slots,     \
    const int32_t* lens, const int32_t* starts, float* out, int B, int Hq, int Hkv, int D,  \
    int L, float scale
/* One-byte caches (kv_quant.h's kinds): codes, and a float32 scale per slot and KV head. */
#define Q8_PARAMS const float* q, const uint8_t* kc, const uint8_t* vc, const float* ksc,   \
    const float* vsc, const int64_t* slots, const int32_t* lens, const int32_t* starts,     \
    float* out, int B, int Hq, int Hkv, int D, int L, float scale, int kind
#define LUT_SETUP float lut[256]; for (int c = 0; c < 256; c++) lut[c] = kvq_to_f32(c, kind);

DEFINE_DECODE(decode_attention_f32_generic_capped, FLOAT_PARAMS(float), float, LOAD_F32,
              UNSCALED, UNSCALED, )
DEFINE_DECODE(decode_attention_bf16_generic_capped, FLOAT_PARAMS(uint16_t), uint16_t,
              LOAD_BF16, UNSCALED, UNSCALED, )
DEFINE_DECODE(decode_attention_q8_generic_capped, Q8_PARAMS, uint8_t, LOAD_Q8, K_SCALE,
              V_SCALE, LUT_SETUP)
/* (the uncapped names, as they were) */
void decode_attention_f32_generic(FLOAT_PARAMS(float)) {
    decode_attention_f32_generic_capped(q, kc, vc, slots, lens, starts, out, B, Hq, Hkv, D, L,
                                        scale, 0.f);
}
void decode_attention_bf16_generic(FLOAT_PARAMS(uint16_t)) {
    decode_attention_bf16_generic_capped(q, kc, vc, slots, lens, starts, out, B, Hq, Hkv, D,
                                         L, scale, 0.f);
}
void decode_attention_q8_generic(Q8_PARAMS) {
    decode_attention_q8_generic_capped(q, kc, vc, ksc, vsc, slots, lens, starts, out, B, Hq,
                                       Hkv, D, L, scale, kind, 0.f);
}

/* ---- The vector body ------------------------------------------------------------------
 *
 * The generic body above keeps each query head's output accumulator in memory and adds
 * every position's V row to it (a load and a store per vector per position and head),
 * reduces every score across its vector on its own, and widens a bf16 K or V element
 * once per query head of its group. This one, for head dims that are a multiple of the
 * vector width VW, is built to spend few instructions a position:
 *   - scores: one vector of partial sums per position, VW positions reduced together by
 *     a transpose-and-add (reduce_lanes: VW - 1 shuffle pairs for VW scores, where a
 *     horizontal sum per score costs log2(VW) each);
 *   - P V: the accumulators of up to GT query heads of a group stay in registers across
 *     the chunk's positions, so each V vector is loaded once for the whole tile;
 *   - a bf16 chunk's K and V rows are widened once into a per-thread buffer of 2 x CHUNK
 *     rows (24 KiB for 3 KV heads x 64) that every query head of the group reads from L1
 *     (with AVX-512 BF16 and a bf16-valued q, K is instead read as bf16 by vdpbf16ps);
 *     fp32 rows are read in place; q is scaled once a sequence.
 * Written with GCC vector types, so -march=native makes it AVX-512 (VW 16), AVX2 (VW 8,
 * 256-bit) or SSE (VW 8 as two 128-bit halves) from one source. P V's sums run in the
 * generic body's order; the scores' in another: results agree to rounding, not bit for
 * bit.
 */
#if defined(__AVX512F__)
#define VW 16
#define GT 4  /* query heads whose P V accumulators are in registers at once (x NB each) */
#else
#define VW 8
#define GT 2
#endif
#define NB 4  /* accumulator vectors of one query head per pass */
typedef float vf __attribute__((vector_size(VW * 4)));
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));
typedef uint16_t vhu __attribute__((vector_size(VW * 2), aligned(2)));
typedef uint16_t vh __attribute__((vector_size(VW * 2)));
typedef uint32_t vu __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

static inline vf vload(const float* p) { return *(const vfu*)p; }
static inline void vstore(float* p, vf v) { *(vfu*)p = v; }
static inline vf vload_bf16(const uint16_t* p) {
    vh x = *(const vhu*)p;
    vu w = __builtin_convertvector(x, vu) << 16;
    return (vf)w;
}

/* VW one-byte codes as floats (kv_quant.h's steps on a vector; the same values). */
typedef uint8_t vbu __attribute__((vector_size(VW), aligned(1)));
typedef int8_t vbs __attribute__((vector_size(VW), aligned(1)));
#if defined(__AVX2__)
#include <immintrin.h>
/* (the generic byte-to-int conversion would move the bytes one at a time) */
static inline vf vload_i8(const uint8_t* p) {
#if VW == 16
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#else
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#endif
}
#else
static inline vf vload_i8(const uint8_t* p) {
    return __builtin_convertvector(__builtin_convertvector(*(const vbs*)p, vi), vf);
}
#endif
static inline __attribute__((always_inline)) vf vload_fp8(const uint8_t* p, const int mb,
                                                          const int bias) {
    const vu b = __builtin_convertvector(*(const vbu*)p, vu);
    const vu mag = b & 0x7fu;
    const vf f = (vf)((mag << (23 - mb)) + ((uint32_t)(127 - bias) << 23));
    const vf sub = (f - kvq_bits_to_f32((uint32_t)(127 - bias) << 23)) * 2.f;
    const vu is_sub = (vu)((mag >> mb) == 0u);
    vu bits = ((vu)sub & is_sub) | ((vu)f & ~is_sub);
    const vu special = mb == 3 ? (vu)(mag == 0x7fu) : (vu)(mag >= 0x7cu);
    const vu special_bits = mb == 3 ? (vu){} + 0x7fc00000u : 0x7f800000u | ((mag & 3u) << 21);
    bits = (bits & ~special) | (special_bits & special);
    return (vf)(bits | ((b & 0x80u) << 24));
}

/* With F16C (AVX2 and up) fp8 goes through the half-precision converter, in fewer
 * instructions: an e5m2 code is a half's upper byte, and an e4m3 code's exponent and
 * mantissa bits under a half's read 2^-8 times its value (subnormals too; the caller
 * multiplies by 256 with the scale, exactly), its NaN code made a half NaN. */
#if defined(__F16C__) && defined(__AVX2__)
#define HALF_FP8 1
#if VW == 16
typedef __m256i vhalf;
#define HALF_WIDEN(p) _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(p)))
#define HALF_TO_VF(h) ((vf)_mm512_cvtph_ps(h))
#else
typedef __m128i vhalf;
#define HALF_WIDEN(p) _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)(p)))
#define HALF_TO_VF(h) ((vf)_mm256_cvtph_ps(h))
#endif
typedef uint16_t v16 __attribute__((vector_size(sizeof(vhalf))));
static inline __attribute__((always_inline)) vf vload_e5m2_half(const uint8_t* p) {
    return HALF_TO_VF((vhalf)((v16)HALF_WIDEN(p) << 8));
}
static inline __attribute__((always_inline)) vf vload_e4m3_half(const uint8_t* p) {
    const v16 b = (v16)HALF_WIDEN(p), mag = b & 0x7f;
    const v16 nan = (v16)(mag == 0x7f) & 0x7e00;  /* S.1111.111: exponent all ones */
    return HALF_TO_VF((vhalf)(((b & 0x80) << 8) | (mag << 7) | nan));
}
#else
#define HALF_FP8 0
#endif

/* A slot's row of Hkv x D codes into floats, each head's times its scale sc[h]. */
static inline __attribute__((always_inline)) void widen_q8(
        float* w, const uint8_t* x, const float* sc, int Hkv, const int D, int kind) {
    for (int h = 0; h < Hkv; h++) {
        const float s = sc[h];
        const uint8_t* xh = x + (int64_t)h * D;
        float* wh = w + (int64_t)h * D;
        if (kind == KV_INT8)
            for (int d = 0; d < D; d += VW) vstore(wh + d, vload_i8(xh + d) * s);
#if HALF_FP8
        else if (kind == KV_E4M3)
            for (int d = 0; d < D; d += VW) vstore(wh + d, vload_e4m3_half(xh + d) * (s * 256.f));
        else
            for (int d = 0; d < D; d += VW) vstore(wh + d, vload_e5m2_half(xh + d) * s);
#else
        else if (kind == KV_E4M3)
            for (int d = 0; d < D; d += VW) vstore(wh + d, vload_fp8(xh + d, 3, 7) * s);
        else
            for (int d = 0; d < D; d += VW) vstore(wh + d, vload_fp8(xh + d, 2, 15) * s);
#endif
    }
}

/* Lane t of the result: the sum of a[t]'s lanes, for t < VW (a is clobbered). Pairs of
 * vectors are added pairwise within 128-bit lanes (HA/HB: what hadd does), twice; then
 * 128-bit lanes are folded across (LA/LB). Each level halves the vectors and keeps
 * their order, so the last one holds a[0..VW) in order. */
#if VW == 16
#define HA {0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30}
#define HB {1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31}
#define LA {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}
#define LB {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}
#else
#define HA {0, 2, 8, 10, 4, 6, 12, 14}
#define HB {1, 3, 9, 11, 5, 7, 13, 15}
#define LA {0, 1, 2, 3, 8, 9, 10, 11}
#define LB {4, 5, 6, 7, 12, 13, 14, 15}
#endif
static inline __attribute__((always_inline)) vf pair_add(vf x, vf y, vi ma, vi mb) {
    return __builtin_shuffle(x, y, ma) + __builtin_shuffle(x, y, mb);
}
static inline __attribute__((always_inline)) vf reduce_lanes(vf* a) {
    const vi ha = HA, hb = HB, la = LA, lb = LB;
    for (int j = 0; j < VW / 2; j++) a[j] = pair_add(a[2 * j], a[2 * j + 1], ha, hb);
    for (int j = 0; j < VW / 4; j++) a[j] = pair_add(a[2 * j], a[2 * j + 1], ha, hb);
#if VW == 16
    for (int j = 0; j < 2; j++) a[j] = pair_add(a[2 * j], a[2 * j + 1], la, lb);
#endif
    return pair_add(a[0], a[1], la, lb);
}

/* Scores of one chunk: s[i][t] = (scaled q_i) . K_t for every query head i, CHUNK of
 * them (krow[t] for t >= tn repeats a valid row: its scores are never read).
 * krow[t]: the fp32 row [Hkv * D] of the chunk's position t. */
static inline __attribute__((always_inline)) void chunk_scores(
        const float* qs, const float* const* krow, float* s, int Hkv, int G, const int D) {
    for (int h = 0; h < Hkv; h++) {
        for (int g = 0; g < G; g++) {
            const int i = h * G + g;
            const float* qi = qs + (int64_t)i * D;
            for (int t0 = 0; t0 < CHUNK; t0 += VW) {
                vf a[VW];
                for (int t = 0; t < VW; t++) {
                    const float* kh = krow[t0 + t] + (int64_t)h * D;
                    a[t] = vload(qi) * vload(kh);
                    for (int j = VW; j < D; j += VW) a[t] += vload(qi + j) * vload(kh + j);
                }
                vstore(s + i * CHUNK + t0, reduce_lanes(a));
            }
        }
    }
}

/* acc_i = alpha_i acc_i + sum_t p[i][t] V_t over the chunk's tn positions, for the query
 * heads g0 .. g0 + gn of KV head h and nb vectors from d0: the tile's gn x nb
 * accumulators in registers, each V vector loaded once for the whole tile. vrow[t]: the
 * fp32 row [Hkv * D] of the chunk's position t. */
static inline __attribute__((always_inline)) void pv_tile(
        const float* const* vrow, const float* s, const float* alpha, float* acc, int tn,
        int h, int G, int g0, const int gn, int d0, const int nb, const int D,
        const char* const* pfk, const char* const* pfv, int pf_bytes) {
    vf a[GT][NB];
    for (int gg = 0; gg < gn; gg++) {
        const int i = h * G + g0 + gg;
        for (int j = 0; j < nb; j++)
            a[gg][j] = vload(acc + (int64_t)i * D + d0 + j * VW) * alpha[i];
    }
    for (int t = 0; t < tn; t++) {
        if (pf_bytes > 0 && pfk[t] != NULL) prefetch_kv_l2(pfk[t], pfv[t], pf_bytes);
        const float* vt = vrow[t] + (int64_t)h * D + d0;
        vf v[NB];
        for (int j = 0; j < nb; j++) v[j] = vload(vt + j * VW);
        for (int gg = 0; gg < gn; gg++) {
            const float p = s[(h * G + g0 + gg) * CHUNK + t];
            for (int j = 0; j < nb; j++) a[gg][j] += p * v[j];
        }
    }
    for (int gg = 0; gg < gn; gg++) {
        const int i = h * G + g0 + gg;
        for (int j = 0; j < nb; j++) vstore(acc + (int64_t)i * D + d0 + j * VW, a[gg][j]);
    }
}

static inline __attribute__((always_inline)) void chunk_pv(
        const float* const* vrow, const float* s, const float* alpha, float* acc, int tn,
        int Hkv, int G, const int D, const char* const* pfk, const char* const* pfv,
        int head_bytes) {
    const char* hk[CHUNK];
    const char* hv[CHUNK];
    for (int h = 0; h < Hkv; h++) {
        /* the first tile of KV head h prefetches head h's K and V of the positions
         * PF_DIST ahead: the loads spread over the chunk's arithmetic */
        for (int t = 0; t < tn && head_bytes > 0; t++) {
            hk[t] = pfk[t] == NULL ? NULL : pfk[t] + (int64_t)h * head_bytes;
            hv[t] = pfv[t] == NULL ? NULL : pfv[t] + (int64_t)h * head_bytes;
        }
        int pf = head_bytes;
        for (int d0 = 0; d0 < D; d0 += NB * VW) {
            const int nb = (D - d0) / VW < NB ? (D - d0) / VW : NB;
            for (int g0 = 0; g0 < G; g0 += GT) {
                const int gn = G - g0 < GT ? G - g0 : GT;
                /* constant tile sizes where they are common, so the loops unroll into
                 * registers (3: Llama and Qwen groups of 3 query heads, as SmolLM2's) */
                if (nb == NB && gn == GT)
                    pv_tile(vrow, s, alpha, acc, tn, h, G, g0, GT, d0, NB, D, hk, hv, pf);
#if GT > 3
                else if (nb == NB && gn == 3)
                    pv_tile(vrow, s, alpha, acc, tn, h, G, g0, 3, d0, NB, D, hk, hv, pf);
#endif
                else
                    for (int gg = 0; gg < gn; gg++) {
                        pv_tile(vrow, s, alpha, acc, tn, h, G, g0 + gg, 1, d0, nb, D, hk,
                                hv, pf);
                        pf = 0;
                    }
                pf = 0;
            }
        }
    }
}

/* bf16 scores by vdpbf16ps (AVX-512 BF16), for a sequence whose q is bf16-valued (a bf16
 * model's; checked per sequence): q and K stay bf16, each product is exact in fp32 and
 * only the order of the fp32 sums differs from the fp32 body's; the score is scaled
 * after the dot product, as torch's bf16 attention does. K rows are then not widened. */
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_DP 1
static inline __attribute__((always_inline)) void chunk_scores_dp(
        const uint16_t* qh, const uint16_t* const* krow, float* s, int Hkv, int G,
        const int D, float scale) {
    for (int h = 0; h < Hkv; h++) {
        for (int g = 0; g < G; g++) {
            const int i = h * G + g;
            const uint16_t* qi = qh + (int64_t)i * D;
            vf a[VW];  /* (VW == CHUNK == 16 here: one reduce_lanes for the chunk) */
            for (int t = 0; t < CHUNK; t++) {
                const uint16_t* kh = krow[t] + (int64_t)h * D;
                __m512 x = _mm512_setzero_ps();
                for (int j = 0; j < D; j += 32)
                    x = _mm512_dpbf16_ps(x, (__m512bh)_mm512_loadu_si512(qi + j),
                                         (__m512bh)_mm512_loadu_si512(kh + j));
                a[t] = (vf)x;
            }
            vstore(s + i * CHUNK, reduce_lanes(a) * scale);
        }
    }
}
#else
#define HAVE_DP 0
static inline void chunk_scores_dp(const uint16_t* qh, const uint16_t* const* krow, float* s,
                                   int Hkv, int G, const int D, float scale) {
    (void)qh; (void)krow; (void)s; (void)Hkv; (void)G; (void)D; (void)scale;
}
#endif

/* q's bf16 bits into qh if every element is a bf16 value (else 0: the fp32 scores). */
static inline int q_as_bf16(const float* q, uint16_t* qh, int n) {
    for (int x = 0; x < n; x++) {
        union { float f; uint32_t u; } v = {q[x]};
        if (v.u & 0xffffu) return 0;
        qh[x] = (uint16_t)(v.u >> 16);
    }
    return 1;
}

/* A long context is cut into segments, each a task of its own (its running max, sum and
 * unnormalised output kept apart), and a sequence's segments are then combined in order:
 * at batch 1 one task per sequence would leave every thread but one idle. The cut
 * depends on the attended length alone (SEG_LEN positions a segment, at most MAX_SEGS),
 * never on the batch or the threads, so a sequence's result is the same whatever runs
 * beside it; a context of up to SEG_LEN positions is one segment, as before. */
#define SEG_LEN 128
#define MAX_SEGS 8

static inline int num_segs(int n) {
    const int s = (n + SEG_LEN - 1) / SEG_LEN;
    return s < 1 ? 1 : s > MAX_SEGS ? MAX_SEGS : s;
}

/* The tasks of a call: sequence, first and end position (relative to its start), and
 * the slot of its partial result (-1: the sequence's only segment, written out at once).
 * part0[b]: the first partial of sequence b (-1 if it has one segment). Returns the
 * number of tasks, or -1 if memory ran out. */
typedef struct { int b, t0, t1, part; } seg_task;

static int plan_segments(const int32_t* lens, const int32_t* starts, int B, seg_task** tasks,
                         int** part0, int* nparts) {
    int nt = 0, np = 0;
    for (int b = 0; b < B; b++) nt += num_segs(lens[b] - starts[b]);
    *tasks = (seg_task*)malloc(sizeof(seg_task) * (size_t)(nt > 0 ? nt : 1));
    *part0 = (int*)malloc(sizeof(int) * (size_t)(B > 0 ? B : 1));
    if (!*tasks || !*part0) { free(*tasks); free(*part0); return -1; }
    int t = 0;
    for (int b = 0; b < B; b++) {
        const int n = lens[b] - starts[b], ns = num_segs(n);
        (*part0)[b] = ns > 1 ? np : -1;
        for (int i = 0; i < ns; i++, t++) {
            (*tasks)[t].b = b;
            (*tasks)[t].t0 = (int)((int64_t)n * i / ns);
            (*tasks)[t].t1 = (int)((int64_t)n * (i + 1) / ns);
            (*tasks)[t].part = ns > 1 ? np++ : -1;
        }
    }
    *nparts = np;
    return nt;
}

/* Sequence b's segments (partials from p0, each acc [Hq, D] then m, l [Hq]) combined in
 * order into its output. */
static void combine_segments(const float* parts, int p0, int ns, float* ob, int Hq, int D) {
    const size_t stride = (size_t)Hq * D + 2 * (size_t)Hq;
    for (int i = 0; i < Hq; i++) {
        float mx = -INFINITY;
        for (int s = 0; s < ns; s++) {
            const float ms = parts[(p0 + s) * stride + (size_t)Hq * D + i];
            mx = ms > mx ? ms : mx;
        }
        float* o = ob + (int64_t)i * D;
        for (int d = 0; d < D; d++) o[d] = 0.f;
        float sum = 0.f;
        for (int s = 0; s < ns; s++) {
            const float* ps = parts + (p0 + s) * stride;
            const float w = expf(ps[(size_t)Hq * D + i] - mx);
            sum += w * ps[(size_t)Hq * D + Hq + i];
            for (int d = 0; d < D; d++) o[d] += w * ps[(int64_t)i * D + d];
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int d = 0; d < D; d++) o[d] *= inv;
    }
}

/* DEXPR: the head dim as a literal (64, 128: the loops unroll) or the argument Dr. It is
 * read inside the parallel region, which the compiler outlines before any inlining.
 * A bf16 chunk's V rows are widened at the chunk's start, in one run of loads that do not
 * wait on each other, rather than inside P V: there each position's loads sit behind the
 * previous position's FMAs and the L2 latency shows (the body 1.3x slower out of cache
 * on a Zen 4, though faster in cache); the chunk's K rows are prefetched into L1 then. */
/* WIDEN: 0 an fp32 cache read in place, 1 a bf16 cache widened a chunk at a time, 2 a
 * one-byte cache dequantised a chunk at a time (ksc, vsc, kind; unused otherwise). */
#define DEFINE_VEC(NAME, T, WIDEN, DEXPR)                                                   \
static void NAME(const float* q, const T* kc, const T* vc, const float* ksc,                \
                 const float* vsc, const int64_t* slots, const int32_t* lens,               \
                 const int32_t* starts, float* out, int B, int Hq, int Hkv, int Dr, int L,  \
                 float scale, int kind, float softcap) {                                    \
    (void)Dr; (void)ksc; (void)vsc; (void)kind;                                             \
    seg_task* tasks;                                                                        \
    int *part0, nparts;                                                                     \
    const int ntasks = plan_segments(lens, starts, B, &tasks, &part0, &nparts);             \
    if (ntasks < 0) return;                                                                 \
    const size_t pstride = (size_t)Hq * DEXPR + 2 * (size_t)Hq;                             \
    float* parts = nparts ? (float*)malloc(sizeof(float) * pstride * nparts) : NULL;        \
    if (nparts && !parts) { free(tasks); free(part0); return; }                             \
    _Pragma("omp parallel")                                                                 \
    {                                                                                       \
    const int D = DEXPR, G = Hq / Hkv, row = Hkv * D;                                       \
    const int row_bytes = (int)(row * sizeof(T));                                           \
    const int pf_dist = WIDEN ? PF_DIST_WIDE : PF_DIST;                                     \
    float* acc = (float*)malloc(sizeof(float) * (size_t)Hq * D);                            \
    float* qs = (float*)malloc(sizeof(float) * (size_t)Hq * D);                             \
    float* s = (float*)malloc(sizeof(float) * (size_t)Hq * CHUNK);                          \
    float* m = (float*)malloc(sizeof(float) * (size_t)Hq * 3);                              \
    float *l = m + Hq, *alpha = m + 2 * Hq;                                                 \
    /* (the widened bf16 or dequantised K and V rows of one chunk; none for fp32) */        \
    float* wide = WIDEN ? (float*)malloc(sizeof(float) * (size_t)2 * CHUNK * row) : NULL;   \
    const int dp_ok = HAVE_DP && WIDEN == 1 && D % 32 == 0;                                 \
    uint16_t* qh = dp_ok ? (uint16_t*)malloc(sizeof(uint16_t) * (size_t)Hq * D) : NULL;     \
    const uint16_t* kraw[CHUNK];                                                            \
    const float* krow[CHUNK];                                                               \
    const float* vrow[CHUNK];                                                               \
    const char* pfk[CHUNK];                                                                 \
    const char* pfv[CHUNK];                                                                 \
    _Pragma("omp for schedule(dynamic, 1)")                                                 \
    for (int task = 0; task < ntasks; task++) {                                             \
        const int b = tasks[task].b, n = tasks[task].t1 - tasks[task].t0;                   \
        const float* qb = q + (int64_t)b * Hq * D;                                          \
        const int64_t* sl = slots + (int64_t)b * L + starts[b] + tasks[task].t0;            \
        for (int x = 0; x < Hq * D; x++) { qs[x] = qb[x] * scale; acc[x] = 0.f; }           \
        const int use_dp = dp_ok && q_as_bf16(qb, qh, Hq * D);                              \
        for (int i = 0; i < Hq; i++) { m[i] = -INFINITY; l[i] = 0.f; }                      \
        for (int t = 0; t < pf_dist && t < n; t++)                                          \
            prefetch_kv_l2(kc + sl[t] * row, vc + sl[t] * row, row_bytes);                  \
        for (int t0 = 0; t0 < n; t0 += CHUNK) {                                             \
            const int tn = n - t0 < CHUNK ? n - t0 : CHUNK;                                 \
            for (int t = 0; t < tn; t++) {                                                  \
                const int ahead = t0 + pf_dist + t < n;                                     \
                if (WIDEN && ahead) /* widened at the chunk's start: fetched in a run */    \
                    prefetch_kv_l2(kc + sl[t0 + pf_dist + t] * row,                         \
                                   vc + sl[t0 + pf_dist + t] * row, row_bytes);             \
                if (WIDEN == 2 && ahead) /* and the slot's scales */                        \
                    prefetch_kv_l2(ksc + sl[t0 + pf_dist + t] * Hkv,                        \
                                   vsc + sl[t0 + pf_dist + t] * Hkv, 1);                    \
                pfk[t] = !WIDEN && ahead /* read in place: fetched during P V */            \
                    ? (const char*)(kc + sl[t0 + pf_dist + t] * row) : NULL;                \
                pfv[t] = !WIDEN && ahead                                                    \
                    ? (const char*)(vc + sl[t0 + pf_dist + t] * row) : NULL;                \
                const T* kt = kc + sl[t0 + t] * row;                                        \
                const T* vt = vc + sl[t0 + t] * row;                                        \
                if (WIDEN == 1) {                                                           \
                    float* wv = wide + (int64_t)(CHUNK + t) * row;                          \
                    for (int x = 0; x < row; x += VW)                                       \
                        vstore(wv + x, vload_bf16((const uint16_t*)vt + x));                \
                    vrow[t] = wv;                                                           \
                } else if (WIDEN == 2) {                                                    \
                    float* wv = wide + (int64_t)(CHUNK + t) * row;                          \
                    widen_q8(wv, (const uint8_t*)vt, vsc + sl[t0 + t] * Hkv, Hkv, D, kind); \
                    vrow[t] = wv;                                                           \
                } else {                                                                    \
                    vrow[t] = (const float*)vt;                                             \
                }                                                                           \
                if (WIDEN && use_dp) { /* K read as bf16 by the scores */                   \
                    prefetch_l1(kt, row_bytes);                                             \
                    kraw[t] = (const uint16_t*)kt;                                          \
                } else if (WIDEN == 1) {                                                    \
                    float* wk = wide + (int64_t)t * row;                                    \
                    for (int x = 0; x < row; x += VW)                                       \
                        vstore(wk + x, vload_bf16((const uint16_t*)kt + x));                \
                    krow[t] = wk;                                                           \
                } else if (WIDEN == 2) {                                                    \
                    float* wk = wide + (int64_t)t * row;                                    \
                    widen_q8(wk, (const uint8_t*)kt, ksc + sl[t0 + t] * Hkv, Hkv, D, kind); \
                    krow[t] = wk;                                                           \
                } else {                                                                    \
                    prefetch_l1(kt, row_bytes);                                             \
                    krow[t] = (const float*)kt;                                             \
                }                                                                           \
            }                                                                               \
            /* the scores run on CHUNK rows: past tn, repeats of a valid one */             \
            if (use_dp) {                                                                   \
                for (int t = tn; t < CHUNK; t++) kraw[t] = kraw[0];                         \
                chunk_scores_dp(qh, kraw, s, Hkv, G, D, scale);                             \
            } else {                                                                        \
                for (int t = tn; t < CHUNK; t++) krow[t] = krow[0];                         \
                chunk_scores(qs, krow, s, Hkv, G, D);                                       \
            }                                                                               \
            for (int i = 0; i < Hq; i++) {                                                  \
                float* si = s + i * CHUNK;                                                  \
                if (softcap > 0.f) softcap_scores(si, tn, softcap);                         \
                float cm = m[i];                                                            \
                for (int t = 0; t < tn; t++) cm = si[t] > cm ? si[t] : cm;                  \
                alpha[i] = expf(m[i] - cm); /* 1 where the max held, 0 on the first chunk */\
                l[i] *= alpha[i];                                                           \
                m[i] = cm;                                                                  \
                float sum = 0.f;                                                            \
                for (int t = 0; t < tn; t++) { si[t] = expf(si[t] - cm); sum += si[t]; }    \
                l[i] += sum;                                                                \
            }                                                                               \
            chunk_pv(vrow, s, alpha, acc, tn, Hkv, G, D, pfk, pfv,                          \
                     WIDEN ? 0 : (int)(D * sizeof(T)));                                     \
        }                                                                                   \
        if (tasks[task].part < 0) {                                                         \
            write_normalized(out + (int64_t)b * Hq * D, acc, l, Hq, D);                     \
        } else {                                                                            \
            float* pp = parts + (size_t)tasks[task].part * pstride;                         \
            memcpy(pp, acc, sizeof(float) * (size_t)Hq * D);                                \
            memcpy(pp + (size_t)Hq * D, m, sizeof(float) * (size_t)Hq);                     \
            memcpy(pp + (size_t)Hq * D + Hq, l, sizeof(float) * (size_t)Hq);                \
        }                                                                                   \
    }                                                                                       \
    if (nparts) { /* (the loop above ends in a barrier: every partial is written) */        \
        _Pragma("omp for schedule(dynamic, 1)")                                             \
        for (int b = 0; b < B; b++)                                                         \
            if (part0[b] >= 0)                                                              \
                combine_segments(parts, part0[b], num_segs(lens[b] - starts[b]),            \
                                 out + (int64_t)b * Hq * D, Hq, D);                         \
    }                                                                                       \
    free(acc); free(qs); free(s); free(m); free(wide); free(qh);                            \
    }                                                                                       \
    free(tasks); free(part0); free(parts);                                                  \
}

DEFINE_VEC(vec_f32_d64, float, 0, 64)
DEFINE_VEC(vec_f32_d128, float, 0, 128)
DEFINE_VEC(vec_f32_dany, float, 0, Dr)
DEFINE_VEC(vec_bf16_d64, uint16_t, 1, 64)
DEFINE_VEC(vec_bf16_d128, uint16_t, 1, 128)
DEFINE_VEC(vec_bf16_dany, uint16_t, 1, Dr)
DEFINE_VEC(vec_q8_d64, uint8_t, 2, 64)
DEFINE_VEC(vec_q8_d128, uint8_t, 2, 128)
DEFINE_VEC(vec_q8_dany, uint8_t, 2, Dr)

/* The entries: the vector body where the head dim is a multiple of the vector width
 * (specialized for 64 and 128, so that its loops unroll into registers), the generic one
 * else. NAME##_capped takes the cap (softcap.h; 0: none); NAME is it uncapped. */
#define DEFINE_ENTRY(NAME, T, VEC, GENERIC)                                                 \
void NAME##_capped(const float* q, const T* kc, const T* vc, const int64_t* slots,          \
                   const int32_t* lens, const int32_t* starts, float* out, int B, int Hq,   \
                   int Hkv, int D, int L, float scale, float softcap) {                     \
    if (D % VW != 0) {                                                                      \
        GENERIC(q, kc, vc, slots, lens, starts, out, B, Hq, Hkv, D, L, scale, softcap);     \
        return;                                                                             \
    }                                                                                       \
    void (*fn)(const float*, const T*, const T*, const float*, const float*,                \
               const int64_t*, const int32_t*, const int32_t*, float*, int, int, int, int,  \
               int, float, int, float) =                                                    \
        D == 64 ? VEC##_d64 : D == 128 ? VEC##_d128 : VEC##_dany;                           \
    fn(q, kc, vc, NULL, NULL, slots, lens, starts, out, B, Hq, Hkv, D, L, scale, 0,         \
       softcap);                                                                            \
}                                                                                           \
void NAME(const float* q, const T* kc, const T* vc, const int64_t* slots,                   \
          const int32_t* lens, const int32_t* starts, float* out, int B, int Hq, int Hkv,   \
          int D, int L, float scale) {                                                      \
    NAME##_capped(q, kc, vc, slots, lens, starts, out, B, Hq, Hkv, D, L, scale, 0.f);       \
}

DEFINE_ENTRY(decode_attention_f32, float, vec_f32, decode_attention_f32_generic_capped)
DEFINE_ENTRY(decode_attention_bf16, uint16_t, vec_bf16, decode_attention_bf16_generic_capped)

/* A one-byte cache (kind: kv_quant.h), dequantised a chunk at a time as a bf16 chunk is
 * widened; the generic body (a 256-entry table of the same values) where D is not a
 * multiple of VW. The _capped entry takes the cap after the kind (0: none). */
void decode_attention_q8_capped(Q8_PARAMS, float softcap) {
    if (D % VW != 0) {
        decode_attention_q8_generic_capped(q, kc, vc, ksc, vsc, slots, lens, starts, out, B,
                                           Hq, Hkv, D, L, scale, kind, softcap);
        return;
    }
    void (*fn)(const float*, const uint8_t*, const uint8_t*, const float*, const float*,
               const int64_t*, const int32_t*, const int32_t*, float*, int, int, int, int,
               int, float, int, float) =
        D == 64 ? vec_q8_d64 : D == 128 ? vec_q8_d128 : vec_q8_dany;
    fn(q, kc, vc, ksc, vsc, slots, lens, starts, out, B, Hq, Hkv, D, L, scale, kind, softcap);
}
void decode_attention_q8(Q8_PARAMS) {
    decode_attention_q8_capped(q, kc, vc, ksc, vsc, slots, lens, starts, out, B, Hq, Hkv, D, L,
                               scale, kind, 0.f);
}

/* Codes to floats, for the tests: the vector steps (n a multiple of VW) or kv_quant.h's. */
void kv_dequant(const uint8_t* codes, float* out, int n, int kind, int vector) {
    for (int i = 0; i < n; i++) out[i] = kvq_to_f32(codes[i], kind);
    if (!vector) return;
    const float one = 1.f;
    for (int i = 0; i + VW <= n; i += VW) widen_q8(out + i, codes + i, &one, 1, VW, kind);
}
