/*
 * Prompt logprobs' reductions over float32 logits rows, one pass over each row: its
 * log-sum-exp, the logprob and rank of a given token, and the top-k ids and logprobs.
 *
 * The numbers are log_softmax's: logprob(x) = (x - max) - log(sum(exp(x - max))), in
 * float32 (the sum in double across blocks). The rank is 1 + the count of logits strictly
 * greater than the token's; the top k are ordered by logit, equal logits lower id first
 * (as torch.max picks). The row is read in blocks small enough for L1: each block's max
 * first, then its exponentials against the running max (the running sum rescaled once
 * when a block raises the max), its rank count, and its top-k candidates (scanned only
 * where the block holds a logit above the current k-th).
 *
 * Rows are float32 or bfloat16 (widened exactly to float32 as they are read: the same
 * numbers as the float32 upcast's). Rows are split over OpenMP threads; an AVX2 + FMA
 * body and a portable scalar one.
 * No -inf or NaN logits (the build has -ffast-math): the caller passes finite rows.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include "bf16.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "simd_math.h"
#endif

#define BLOCK 512 /* floats: 2 KiB, a block is re-read from L1 */
#define MAX_K 64

int logprob_rows_simd(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

int logprob_rows_max_k(void) { return MAX_K; }

/* The k best (value, id) so far, best first; a new id is always the largest seen, so an
 * equal value goes after the ones already held. */
typedef struct {
    float val[MAX_K];
    int32_t id[MAX_K];
    int n, k;
} TopK;

static inline float topk_floor(const TopK* t) {
    return t->n < t->k ? -FLT_MAX : t->val[t->k - 1];
}

static inline void topk_offer(TopK* t, float v, int32_t id) {
    if (t->k == 0 || (t->n == t->k && !(v > t->val[t->k - 1]))) return;
    int i = t->n < t->k ? t->n++ : t->k - 1;
    while (i > 0 && v > t->val[i - 1]) {
        t->val[i] = t->val[i - 1];
        t->id[i] = t->id[i - 1];
        i--;
    }
    t->val[i] = v;
    t->id[i] = id;
}

/* Element i of a row of float32 (bf16 = 0) or bfloat16 (bf16 = 1) values, as float32;
 * a constant bf16 at each call site, so each element type gets its own loops. */
static inline float at(const void* x, int i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t*)x)[i]) : ((const float*)x)[i];
}

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 load8(const void* x, int i, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float*)x + i);
    const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)x + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

/* One row: the running max, the sum of exp(x - max), the rank count, the top k. */
static inline __attribute__((always_inline)) void reduce_row(
        const void* x, int bf16, int vocab, float xt, TopK* top, float* max_out,
        double* sum_out, int64_t* greater_out) {
    float m = -FLT_MAX;
    double s = 0.0;
    int64_t greater = 0;
    for (int b0 = 0; b0 < vocab; b0 += BLOCK) {
        const int n = vocab - b0 < BLOCK ? vocab - b0 : BLOCK;
        int j = 0;
        float bm = -FLT_MAX;
        float bs = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
        __m256 vm = _mm256_set1_ps(-FLT_MAX);
        const __m256 vt = _mm256_set1_ps(xt);
        __m256i vg = _mm256_setzero_si256();
        for (; j + 8 <= n; j += 8) {
            const __m256 v = load8(x, b0 + j, bf16);
            vm = _mm256_max_ps(vm, v);
            /* a true lane is all ones (-1): subtracting it counts it */
            vg = _mm256_sub_epi32(vg, _mm256_castps_si256(_mm256_cmp_ps(v, vt, _CMP_GT_OQ)));
        }
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
        bm = _mm_cvtss_f32(h);
        __m128i g = _mm_add_epi32(_mm256_castsi256_si128(vg), _mm256_extracti128_si256(vg, 1));
        g = _mm_add_epi32(g, _mm_shuffle_epi32(g, 0x4e));
        g = _mm_add_epi32(g, _mm_shuffle_epi32(g, 0xb1));
        greater += _mm_cvtsi128_si32(g);
#endif
        for (int i = j; i < n; i++) {
            const float v = at(x, b0 + i, bf16);
            bm = v > bm ? v : bm;
            greater += v > xt;
        }
        if (bm > m) {
            if (s != 0.0) s *= exp((double)m - (double)bm);
            m = bm;
        }
        j = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 vmax = _mm256_set1_ps(m);
        __m256 vs = _mm256_setzero_ps();
        for (; j + 8 <= n; j += 8)
            vs = _mm256_add_ps(vs, exp256(_mm256_sub_ps(load8(x, b0 + j, bf16), vmax)));
        __m128 q = _mm_add_ps(_mm256_castps256_ps128(vs), _mm256_extractf128_ps(vs, 1));
        q = _mm_add_ps(q, _mm_movehl_ps(q, q));
        q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
        bs = _mm_cvtss_f32(q);
#endif
        for (int i = j; i < n; i++) bs += expf(at(x, b0 + i, bf16) - m);
        s += bs;
        if (top->k && bm > topk_floor(top)) {
            j = 0;
#if defined(__AVX2__) && defined(__FMA__)
            for (; j + 8 <= n; j += 8) {
                const __m256 v = load8(x, b0 + j, bf16);
                int mask = _mm256_movemask_ps(
                    _mm256_cmp_ps(v, _mm256_set1_ps(topk_floor(top)), _CMP_GT_OQ));
                while (mask) {
                    const int lane = __builtin_ctz(mask);
                    topk_offer(top, at(x, b0 + j + lane, bf16), b0 + j + lane);
                    mask &= mask - 1;
                }
            }
#endif
            for (int i = j; i < n; i++) topk_offer(top, at(x, b0 + i, bf16), b0 + i);
        }
    }
    *max_out = m;
    *sum_out = s;
    *greater_out = greater;
}

static int reduce_rows(const void* logits, int bf16, int rows, int vocab, int64_t ld,
                       const int64_t* targets, int k, float* token_lp, int32_t* rank,
                       int64_t* top_ids, float* top_lp) {
    if (rows < 0 || vocab <= 0 || ld < vocab || k < 0 || k > MAX_K || k > vocab)
        return -1;
    for (int r = 0; r < rows; r++)
        if (targets[r] < 0 || targets[r] >= vocab) return -1;
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        const char* x = (const char*)logits + (int64_t)r * ld * (bf16 ? 2 : 4);
        const float xt = at(x, (int)targets[r], bf16);
        TopK top;
        top.n = 0;
        top.k = k;
        float m;
        double s;
        int64_t greater;
        if (bf16)
            reduce_row(x, 1, vocab, xt, &top, &m, &s, &greater);
        else
            reduce_row(x, 0, vocab, xt, &top, &m, &s, &greater);
        const float log_sum = (float)log(s);
        token_lp[r] = (xt - m) - log_sum;
        rank[r] = (int32_t)(greater + 1);
        for (int i = 0; i < k; i++) {
            top_ids[(int64_t)r * k + i] = top.id[i];
            top_lp[(int64_t)r * k + i] = (top.val[i] - m) - log_sum;
        }
    }
    return 0;
}

/*
 * logits: rows x vocab values (float32, or bfloat16 for the _bf16 entry), row r at
 * logits + r * ld elements. targets[r]: the token scored in row r (0 <= id < vocab).
 * Out: token_lp[r], rank[r], and k ids and logprobs a row in top_ids / top_lp (rows x k;
 * unused when k is 0). Returns 0, or -1 for bad arguments.
 */
int logprob_rows_f32(const float* logits, int rows, int vocab, int64_t ld,
                     const int64_t* targets, int k, float* token_lp, int32_t* rank,
                     int64_t* top_ids, float* top_lp) {
    return reduce_rows(logits, 0, rows, vocab, ld, targets, k, token_lp, rank, top_ids,
                       top_lp);
}

int logprob_rows_bf16(const uint16_t* logits, int rows, int vocab, int64_t ld,
                      const int64_t* targets, int k, float* token_lp, int32_t* rank,
                      int64_t* top_ids, float* top_lp) {
    return reduce_rows(logits, 1, rows, vocab, ld, targets, k, token_lp, rank, top_ids,
                       top_lp);
}
