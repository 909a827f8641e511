/*
 * y = x @ dequant(W)^T (+ bias) for float32 x and an int8 or int4 weight, the weight
 * widened to float32 in registers or in a small per-thread buffer (never a float copy of
 * the whole weight): a decode step reads one or half a byte per weight, which is what it
 * is bound by at a few rows.
 *
 * W is packed at load (model/quant/linear.py) in panels of 16 output rows, K-contiguous,
 * as the float GEMM packs its weights (gemm.c): panel p, column k holds outputs
 * 16p..16p+15 (zeros past N), int8: 16 bytes at (p * K + k) * 16; int4 (unsigned 0..15):
 * 8 bytes at (p * K + k) * 8, byte j holding output j (low nibble) and j + 8 (high).
 * scales and zeros (NULL: none) likewise [P, K / group, 16] floats: w = (q - zero) * scale.
 * A panel is one long contiguous stream (the hardware prefetcher follows it; row-major
 * rows of 576 bytes were too short for it to ramp up on), a k step widens 16 outputs'
 * weights at once, and no group size or K is too odd for the vector body.
 *
 * The value multiplied by x: q itself (exact in float32). With one scale a row and no
 * zeros, each output is one FMA chain over k ascending, multiplied by its scale at the
 * end. Otherwise (groups, or zero points) each group's chain d = sum x q starts at zero
 * and is folded into the output's total once at the group's end: total += scale * (d -
 * zero * sum of the group's x) (the x sums computed once a call): the zero point and scale
 * cost an FMA a group, not a subtract and a multiply a weight. The scalar body (no AVX2)
 * multiplies by the dequantised weight instead. Every path of a body does the same
 * operations in the same order whatever the row count: a row's result does not depend on
 * the rows beside it.
 *
 * glu (a [gate; up] projection of 2I rows, I a multiple of 16, packed with panels in pairs:
 * gate rows 16i..16i+15 in panel 2i, the up rows beside them in panel 2i+1): y gets
 * silu(gate) * up, [M, I], each thread combining the pairs it computed (in a scratch of
 * [M, 2I]) as soon as both panels are done, so no [M, 2I] intermediate leaves the call.
 *
 * Up to DIRECT_MAX rows the weights are widened in registers, one or two panels a pass
 * sharing each broadcast of x. Past it a task widens a KC x 16 slice of a panel once into
 * a float buffer (L1) and runs 6 x 16 register tiles over it (gemm.c's tile: 12
 * accumulators, two loads and six broadcasts a k step), the slivers' accumulators
 * carried over K blocks through y (loaded back into the same FMA chain).
 */
#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "simd_math.h"
#endif

#define DIRECT_MAX 4 /* rows of x up to which the weights are widened in registers */
#define KC 256       /* a buffered slice: 256 x 16 floats, 16 KB (inside L1) */
#define MR 6         /* rows of a buffered tile */
/* Bytes ahead of its reads in a panel's stream that a pass prefetches (a whole decode
 * step's weights come from memory). */
#define PF_DIST 2048

int qgemm_f32_simd(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* The weight as the kernel reads it. chan: one group a row (scale applied at the end). */
typedef struct {
    const uint8_t* w;
    int bits, K, N, group, groups, chan;
    const float* scales; /* [P, groups, 16] */
    const float* zeros;
    int fold;         /* scales (and zeros) applied per group to the sums (SIMD body) */
    const float* xs;  /* fold with zeros: [M, groups] sums of x over each group */
} QW;

/* The value x[k] is multiplied by for output n (see above). */
static inline float w_at(const QW* q, int n, int k) {
    const int p = n >> 4, j = n & 15;
    const size_t at = (size_t)p * q->K + k;
    float v;
    if (q->bits == 8) {
        v = (float)((const int8_t*)q->w)[at * 16 + j];
    } else {
        const uint8_t b = q->w[at * 8 + (j & 7)];
        v = (float)(j >= 8 ? b >> 4 : b & 15);
    }
    const size_t s = ((size_t)p * q->groups + k / q->group) * 16 + j;
    if (q->zeros) v -= q->zeros[s];
    return q->chan ? v : v * q->scales[s];
}

static inline float finish(const QW* q, float acc, int n, const float* bias) {
    if (q->chan && !q->fold) acc *= q->scales[(size_t)(n >> 4) * 16 + (n & 15)];
    return acc + (bias ? bias[n] : 0.0f);
}

#if defined(__AVX2__) && defined(__FMA__)
/* Column k of panel p (16 outputs) as the kernel multiplies them, in v[0] (outputs 0-7)
 * and v[1] (8-15); sz: the group's 16 scales (and zeros at sz + zoff). */
static inline __attribute__((always_inline)) void
deq16(const QW* q, int p, int k, const float* s, const float* z, const int BITS,
      const int ZERO, const int CHAN, __m256 v[2]) {
    const size_t at = (size_t)p * q->K + k;
    if (BITS == 8) {
        /* two 8-byte loads, each folded into its sign extension (one 16-byte load took a
         * shuffle more for its upper half) */
        const uint8_t* b = q->w + at * 16;
        v[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)b)));
        v[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b + 8))));
    } else {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q->w + at * 8)));
        v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
        v[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
    }
    for (int h = 0; h < 2; h++) {
        if (ZERO) v[h] = _mm256_sub_ps(v[h], _mm256_loadu_ps(z + 8 * h));
        if (!CHAN) v[h] = _mm256_mul_ps(v[h], _mm256_loadu_ps(s + 8 * h));
    }
}

/* The tile's sums (acc[r][2 * pp + h]: row r, panel p0 + pp, half h) into y: the scale
 * for one group a row, the bias, the outputs past N left out. */
static inline __attribute__((always_inline)) void
store_sums(const QW* q, __m256 acc[][8], const int R, const int P, int p0, const float* bias,
           float* y, int ldy) {
    for (int r = 0; r < R; r++)
        for (int pp = 0; pp < P; pp++) {
            float t[16];
            _mm256_storeu_ps(t, acc[r][2 * pp]);
            _mm256_storeu_ps(t + 8, acc[r][2 * pp + 1]);
            const int n0 = (p0 + pp) * 16;
            for (int j = 0; j < 16 && n0 + j < q->N; j++)
                y[(size_t)r * ldy + n0 + j] = finish(q, t[j], n0 + j, bias);
        }
}

/* R (1..DIRECT_MAX) rows of x against P (1..4; R * P <= 4) panels from p0, widened in
 * registers. */
static inline __attribute__((always_inline)) void
direct_tile(const float* x, int ldx, const QW* q, int p0, const int R, const int P,
            const int BITS, const int ZERO, const int CHAN, const float* bias, float* y,
            int ldy) {
    const int FOLD = ZERO || !CHAN;
    __m256 acc[DIRECT_MAX][8], tot[DIRECT_MAX][8];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 2 * P; i++) acc[r][i] = tot[r][i] = _mm256_setzero_ps();
    for (int g = 0; g < q->groups; g++) {
        if (FOLD)
            for (int r = 0; r < R; r++)
                for (int i = 0; i < 2 * P; i++) acc[r][i] = _mm256_setzero_ps();
        const float* s[4];
        const float* z[4];
        for (int pp = 0; pp < P; pp++) {
            const size_t i = ((size_t)(p0 + pp) * q->groups + g) * 16;
            s[pp] = q->scales + i;
            z[pp] = ZERO ? q->zeros + i : NULL;
        }
        const int k1 = (g + 1) * q->group;
        for (int k = g * q->group; k < k1; k++) {
            /* a line PF_DIST ahead of each panel's stream for every 64 bytes read */
            if (k % (BITS == 8 ? 4 : 8) == 0)
                for (int pp = 0; pp < P; pp++)
                    _mm_prefetch((const char*)q->w + ((size_t)(p0 + pp) * q->K + k)
                                 * (BITS == 8 ? 16 : 8) + PF_DIST, _MM_HINT_T0);
            __m256 w[4][2];
            for (int pp = 0; pp < P; pp++)
                deq16(q, p0 + pp, k, s[pp], z[pp], BITS, FOLD ? 0 : ZERO, FOLD ? 1 : CHAN,
                      w[pp]);
            for (int r = 0; r < R; r++) {
                const __m256 xv = _mm256_broadcast_ss(x + (size_t)r * ldx + k);
                for (int pp = 0; pp < P; pp++) {
                    acc[r][2 * pp] = _mm256_fmadd_ps(xv, w[pp][0], acc[r][2 * pp]);
                    acc[r][2 * pp + 1] = _mm256_fmadd_ps(xv, w[pp][1], acc[r][2 * pp + 1]);
                }
            }
        }
        if (FOLD)
            for (int pp = 0; pp < P; pp++)
                for (int h = 0; h < 2; h++) {
                    const __m256 sv = _mm256_loadu_ps(s[pp] + 8 * h);
                    for (int r = 0; r < R; r++) {
                        __m256 t = acc[r][2 * pp + h];
                        if (ZERO)
                            t = _mm256_fnmadd_ps(_mm256_loadu_ps(z[pp] + 8 * h),
                                                 _mm256_set1_ps(q->xs[(size_t)r * q->groups + g]),
                                                 t);
                        tot[r][2 * pp + h] = _mm256_fmadd_ps(sv, t, tot[r][2 * pp + h]);
                    }
                }
    }
    /* (a copy: handing acc itself to store_sums kept it on the stack through the loop) */
    __m256 sums[DIRECT_MAX][8];
    for (int r = 0; r < R; r++)
        for (int i = 0; i < 2 * P; i++) sums[r][i] = FOLD ? tot[r][i] : acc[r][i];
    store_sums(q, sums, R, P, p0, bias, y, ldy);
}

/* Panels p0..p1, rows 0..M (M <= DIRECT_MAX). */
static inline __attribute__((always_inline)) void
task_direct(const float* x, int M, int ldx, const QW* q, int p0, int p1, const float* bias,
            float* y, int ldy, const int BITS, const int ZERO, const int CHAN) {
    for (int p = p0; p < p1;) {
        /* at one row, four panels a pass with one scale a row and no zeros (eight FMA
         * chains: more than the FMA latency needs hidden; with a group's scales and zeros
         * in registers too, four spill), else two; two at two rows, one at 3-4 */
        const int left = p1 - p, wide = CHAN && !ZERO;
        const int P = M == 1 ? (wide && left >= 4 ? 4 : left >= 2 ? 2 : 1)
                             : (M == 2 && left >= 2) ? 2 : 1;
#define DT(R, PP) direct_tile(x, ldx, q, p, R, PP, BITS, ZERO, CHAN, bias, y, ldy)
        if (P == 4) { if (wide) DT(1, 4); }
        else if (P == 2) { if (M == 1) DT(1, 2); else DT(2, 2); }
        else if (M == 1) DT(1, 1);
        else if (M == 2) DT(2, 1);
        else if (M == 3) DT(3, 1);
        else DT(4, 1);
#undef DT
        p += P;
    }
}

/* Slice k0..k0 + kc of panel p widened into buf (kc x 16 floats). */
static inline __attribute__((always_inline)) void
widen_slice(const QW* q, int p, int k0, int kc, float* buf, const int BITS, const int ZERO,
            const int CHAN) {
    const uint8_t* pf = q->w + ((size_t)p * q->K + k0) * (BITS == 8 ? 16 : 8) + PF_DIST;
    for (int k = k0; k < k0 + kc;) {
        const int g = k / q->group, k1 = (g + 1) * q->group < k0 + kc ? (g + 1) * q->group
                                                                     : k0 + kc;
        const size_t i = ((size_t)p * q->groups + g) * 16;
        for (; k < k1; k++) {
            if ((k - k0) % (BITS == 8 ? 4 : 8) == 0)
                _mm_prefetch((const char*)pf + (size_t)(k - k0) * (BITS == 8 ? 16 : 8),
                             _MM_HINT_T0);
            __m256 v[2];
            deq16(q, p, k, q->scales + i, ZERO ? q->zeros + i : NULL, BITS, ZERO, CHAN, v);
            _mm256_store_ps(buf + (size_t)(k - k0) * 16, v[0]);
            _mm256_store_ps(buf + (size_t)(k - k0) * 16 + 8, v[1]);
        }
    }
}

/* R (1..MR) rows of x (at this slice's first column) against a widened slice; rows past
 * R (up to RMAX: 2, 4 or 6, the tile's size) read row 0 again (their sums are never
 * stored). The accumulators start from y's
 * partial sums when carry (the same FMA chain continues) and end in y (a last panel past
 * N: in spill, M x 16 floats) or, on the last slice, through finish. Named accumulators,
 * as gemm.c's tile: an array of them was kept on the stack. */
static inline __attribute__((always_inline)) void
buffer_tile(const float* x, int ldx, const float* restrict buf, int kc, int R, int carry,
            int last, const QW* q, int p, const float* bias, float* y, int ldy, float* spill,
            const int RMAX) {
    const float* restrict a0 = x;
    const float* restrict a1 = R > 1 ? x + (size_t)ldx : x;
    const float* restrict a2 = R > 2 ? x + 2 * (size_t)ldx : x;
    const float* restrict a3 = R > 3 ? x + 3 * (size_t)ldx : x;
    const float* restrict a4 = R > 4 ? x + 4 * (size_t)ldx : x;
    const float* restrict a5 = R > 5 ? x + 5 * (size_t)ldx : x;
    const int full = (p + 1) * 16 <= q->N;
    float* part = full ? y + p * 16 : spill;
    const int ldp = full ? ldy : 16;
    __m256 c[MR][2];
    for (int r = 0; r < MR; r++)
        for (int h = 0; h < 2; h++)
            c[r][h] = carry && r < R ? _mm256_loadu_ps(part + (size_t)r * ldp + 8 * h)
                                     : _mm256_setzero_ps();
    __m256 c00 = c[0][0], c01 = c[0][1], c10 = c[1][0], c11 = c[1][1], c20 = c[2][0],
           c21 = c[2][1], c30 = c[3][0], c31 = c[3][1], c40 = c[4][0], c41 = c[4][1],
           c50 = c[5][0], c51 = c[5][1];
    for (int k = 0; k < kc; k++) {
        const __m256 b0 = _mm256_load_ps(buf + (size_t)k * 16);
        const __m256 b1 = _mm256_load_ps(buf + (size_t)k * 16 + 8);
        __m256 xv = _mm256_broadcast_ss(a0 + k);
        c00 = _mm256_fmadd_ps(xv, b0, c00); c01 = _mm256_fmadd_ps(xv, b1, c01);
        if (RMAX > 1) {
            xv = _mm256_broadcast_ss(a1 + k);
            c10 = _mm256_fmadd_ps(xv, b0, c10); c11 = _mm256_fmadd_ps(xv, b1, c11);
        }
        if (RMAX > 2) {
            xv = _mm256_broadcast_ss(a2 + k);
            c20 = _mm256_fmadd_ps(xv, b0, c20); c21 = _mm256_fmadd_ps(xv, b1, c21);
            xv = _mm256_broadcast_ss(a3 + k);
            c30 = _mm256_fmadd_ps(xv, b0, c30); c31 = _mm256_fmadd_ps(xv, b1, c31);
        }
        if (RMAX > 4) {
            xv = _mm256_broadcast_ss(a4 + k);
            c40 = _mm256_fmadd_ps(xv, b0, c40); c41 = _mm256_fmadd_ps(xv, b1, c41);
            xv = _mm256_broadcast_ss(a5 + k);
            c50 = _mm256_fmadd_ps(xv, b0, c50); c51 = _mm256_fmadd_ps(xv, b1, c51);
        }
    }
    const __m256 out[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21},
                               {c30, c31}, {c40, c41}, {c50, c51}};
    for (int r = 0; r < R; r++) {
        float t[16];
        _mm256_storeu_ps(t, out[r][0]);
        _mm256_storeu_ps(t + 8, out[r][1]);
        if (!last) {
            memcpy(part + (size_t)r * ldp, t, sizeof(t));
        } else {
            for (int j = 0; j < 16 && p * 16 + j < q->N; j++)
                y[(size_t)r * ldy + p * 16 + j] = finish(q, t[j], p * 16 + j, bias);
        }
    }
}

/* buffer_tile's k step, for buffer_tile_fold's group sweeps */
#define TILE_STEP(k)                                                                     \
    do {                                                                                 \
        const __m256 b0 = _mm256_load_ps(buf + (size_t)(k) * 16);                        \
        const __m256 b1 = _mm256_load_ps(buf + (size_t)(k) * 16 + 8);                    \
        __m256 xv = _mm256_broadcast_ss(a0 + (k));                                       \
        c00 = _mm256_fmadd_ps(xv, b0, c00); c01 = _mm256_fmadd_ps(xv, b1, c01);          \
        if (RMAX > 1) {                                                                  \
            xv = _mm256_broadcast_ss(a1 + (k));                                          \
            c10 = _mm256_fmadd_ps(xv, b0, c10); c11 = _mm256_fmadd_ps(xv, b1, c11);      \
        }                                                                                \
        if (RMAX > 2) {                                                                  \
            xv = _mm256_broadcast_ss(a2 + (k));                                          \
            c20 = _mm256_fmadd_ps(xv, b0, c20); c21 = _mm256_fmadd_ps(xv, b1, c21);      \
            xv = _mm256_broadcast_ss(a3 + (k));                                          \
            c30 = _mm256_fmadd_ps(xv, b0, c30); c31 = _mm256_fmadd_ps(xv, b1, c31);      \
        }                                                                                \
        if (RMAX > 4) {                                                                  \
            xv = _mm256_broadcast_ss(a4 + (k));                                          \
            c40 = _mm256_fmadd_ps(xv, b0, c40); c41 = _mm256_fmadd_ps(xv, b1, c41);      \
            xv = _mm256_broadcast_ss(a5 + (k));                                          \
            c50 = _mm256_fmadd_ps(xv, b0, c50); c51 = _mm256_fmadd_ps(xv, b1, c51);      \
        }                                                                                \
    } while (0)

/* buffer_tile for the folded kinds: a slice of whole groups (columns k0..k0 + kc of
 * panel p, widened to q alone), each group's sums from zero in registers, then folded
 * into the totals in y (or spill) as direct_tile folds them; the totals start at zero on
 * the first slice and get the bias on the last. xs: row 0's group sums. */
static inline __attribute__((always_inline)) void
buffer_tile_fold(const float* x, int ldx, const float* restrict buf, int k0, int kc, int R,
                 int first, int last, const QW* q, int p, const float* bias, float* y,
                 int ldy, float* spill, const float* xs, const int RMAX, const int ZERO) {
    const float* restrict a0 = x;
    const float* restrict a1 = R > 1 ? x + (size_t)ldx : x;
    const float* restrict a2 = R > 2 ? x + 2 * (size_t)ldx : x;
    const float* restrict a3 = R > 3 ? x + 3 * (size_t)ldx : x;
    const float* restrict a4 = R > 4 ? x + 4 * (size_t)ldx : x;
    const float* restrict a5 = R > 5 ? x + 5 * (size_t)ldx : x;
    const int full = (p + 1) * 16 <= q->N;
    float* part = full ? y + p * 16 : spill;
    const int ldp = full ? ldy : 16;
    if (first)
        for (int r = 0; r < R; r++) memset(part + (size_t)r * ldp, 0, 16 * sizeof(float));
    for (int ka = 0; ka < kc;) {
        const int g = (k0 + ka) / q->group;
        const int kb = (g + 1) * q->group - k0;
        __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00,
               c21 = c00, c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
        for (int k = ka; k < kb; k++) TILE_STEP(k);
        const __m256 out[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21},
                                   {c30, c31}, {c40, c41}, {c50, c51}};
        const size_t i = ((size_t)p * q->groups + g) * 16;
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++) {
                __m256 t = out[r][h];
                if (ZERO)
                    t = _mm256_fnmadd_ps(_mm256_loadu_ps(q->zeros + i + 8 * h),
                                         _mm256_set1_ps(xs[(size_t)r * q->groups + g]), t);
                float* at = part + (size_t)r * ldp + 8 * h;
                _mm256_storeu_ps(at, _mm256_fmadd_ps(_mm256_loadu_ps(q->scales + i + 8 * h), t,
                                                     _mm256_loadu_ps(at)));
            }
        ka = kb;
    }
    if (last)
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 16 && p * 16 + j < q->N; j++)
                y[(size_t)r * ldy + p * 16 + j] =
                    finish(q, part[(size_t)r * ldp + j], p * 16 + j, bias);
}

static __thread float* wide_buf = NULL;
static __thread int wide_cap = 0; /* columns wide_buf holds (x 16 floats) */

/* Panels p0..p1, any rows: each slice widened once, then every sliver of rows over it.
 * spill: partial sums of a last panel past N (M x 16 floats). Returns -1 if the buffer
 * could not be allocated. */
static inline __attribute__((always_inline)) int
task_buffered(const float* x, int M, int ldx, const QW* q, int p0, int p1,
              const float* bias, float* y, int ldy, float* spill, const int BITS,
              const int ZERO, const int CHAN) {
    const int FOLD = ZERO || !CHAN;
    /* folded: slices of whole groups (a group's sums fold at its end) */
    const int slice = !FOLD ? KC : q->group <= KC ? KC / q->group * q->group : q->group;
    if (wide_cap < slice) {
        free(wide_buf);
        wide_cap = 0;
        if ((wide_buf = (float*)aligned_alloc(64, sizeof(float) * 16 * (size_t)slice)) == NULL)
            return -1;
        wide_cap = slice;
    }
    float* buf = wide_buf;
    const int nkb = (q->K + slice - 1) / slice;
    for (int p = p0; p < p1; p++)
        for (int kb = 0; kb < nkb; kb++) {
            const int k0 = kb * slice, kc = q->K - k0 < slice ? q->K - k0 : slice;
            widen_slice(q, p, k0, kc, buf, BITS, FOLD ? 0 : ZERO, FOLD ? 1 : CHAN);
            for (int m = 0; m < M; m += MR) {
                /* a sliver of 6 rows; a last one of 1-2 or 3-4 in a 2- or 4-row tile */
                const int R = M - m < MR ? M - m : MR;
#define BT(RMAX) buffer_tile(x + (size_t)m * ldx + k0, ldx, buf, kc, R, kb > 0, kb == nkb - 1, \
                             q, p, bias, y + (size_t)m * ldy, ldy, spill + (size_t)m * 16, RMAX)
#define BF(RMAX) buffer_tile_fold(x + (size_t)m * ldx + k0, ldx, buf, k0, kc, R, kb == 0,      \
                                  kb == nkb - 1, q, p, bias, y + (size_t)m * ldy, ldy,          \
                                  spill + (size_t)m * 16,                                       \
                                  q->xs ? q->xs + (size_t)m * q->groups : NULL, RMAX, ZERO)
                if (FOLD) {
                    if (R <= 2) BF(2);
                    else if (R <= 4) BF(4);
                    else BF(MR);
                } else if (R <= 2) BT(2);
                else if (R <= 4) BT(4);
                else BT(MR);
#undef BT
#undef BF
            }
        }
    return 0;
}

/* silu(g) * u = g / (1 + e^-g) * u, as gemm.c's fused gate/up (the exponent clamped so
 * that it stays finite, as -ffast-math assumes) */
static inline __m256 silu_mul256(__m256 g, __m256 u) {
    const __m256 e = exp256(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g),
                                          _mm256_set1_ps(80.f)));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}

/* Pairs a..b of a glu scratch t ([M, 2I], panel pair i at columns 32i..32i+31) into y. */
static void glu_pairs(const float* t, int M, int N, int a, int b, float* y, int ldy) {
    for (int m = 0; m < M; m++)
        for (int i = a; i < b; i++)
            for (int h = 0; h < 2; h++) {
                const float* g = t + (size_t)m * N + 32 * (size_t)i + 8 * h;
                _mm256_storeu_ps(y + (size_t)m * ldy + 16 * (size_t)i + 8 * h,
                                 silu_mul256(_mm256_loadu_ps(g), _mm256_loadu_ps(g + 16)));
            }
}

#define BY_KIND(CALL)                                                                    \
    do {                                                                                 \
        const int z_ = q.zeros != NULL;                                                  \
        if (q.bits == 8) {                                                               \
            if (q.chan) { if (z_) CALL(8, 1, 1); else CALL(8, 0, 1); }                   \
            else { if (z_) CALL(8, 1, 0); else CALL(8, 0, 0); }                          \
        } else {                                                                         \
            if (q.chan) { if (z_) CALL(4, 1, 1); else CALL(4, 0, 1); }                   \
            else { if (z_) CALL(4, 1, 0); else CALL(4, 0, 0); }                          \
        }                                                                                \
    } while (0)
#endif

/* Outputs of panels p0..p1, rows 0..M, one at a time. */
static __attribute__((unused)) void task_scalar(const float* x, int M, int ldx, const QW* q, int p0, int p1,
                        const float* bias, float* y, int ldy) {
    for (int n = p0 * 16; n < p1 * 16 && n < q->N; n++)
        for (int m = 0; m < M; m++) {
            const float* xr = x + (size_t)m * ldx;
            float acc = 0.0f;
            for (int k = 0; k < q->K; k++) acc += xr[k] * w_at(q, n, k);
            y[(size_t)m * ldy + n] = finish(q, acc, n, bias);
        }
}

/* Returns 0, -1 for arguments it does not take, or -2 if memory ran out. */
int qgemm_f32(const float* x, int M, int K, int ldx, const void* w, int bits, int N,
              const float* scales, const float* zeros, int group, const float* bias,
              float* y, int ldy, int glu) {
    if (M < 0 || N <= 0 || K <= 0 || group <= 0 || K % group || (bits != 8 && bits != 4))
        return -1;
#if defined(__AVX2__) && defined(__FMA__)
    if (glu && (N % 32 || bias != NULL)) return -1;
#else
    if (glu) return -1; /* (the scalar body has no fused gate/up) */
#endif
    QW q = {(const uint8_t*)w, bits, K, N, group, K / group, K == group, scales, zeros, 0,
            NULL};
    const int np = (N + 15) / 16;
    int failed = 0;
    if (M == 0) return 0;
#if defined(__AVX2__) && defined(__FMA__)
    q.fold = zeros != NULL || !q.chan;
    float* xs = NULL;
    if (zeros != NULL) {
        /* each row's sum over each group, one FMA chain (x * 1) a group: FMAs are not
         * reassociated under -ffast-math, so every call sums in the same order */
        xs = (float*)malloc(sizeof(float) * (size_t)M * q.groups);
        if (xs == NULL) return -2;
        const __m128 one = _mm_set_ss(1.0f);
        for (int m = 0; m < M; m++)
            for (int g = 0; g < q.groups; g++) {
                __m128 sum = _mm_setzero_ps();
                const float* xr = x + (size_t)m * ldx + (size_t)g * group;
                for (int k = 0; k < group; k++) sum = _mm_fmadd_ss(_mm_load_ss(xr + k), one, sum);
                xs[(size_t)m * q.groups + g] = _mm_cvtss_f32(sum);
            }
        q.xs = xs;
    }
    /* glu: the projection's 2I outputs into a scratch, y gets the pairs combined */
    float* const out = y;
    const int ldo = ldy;
    if (glu) {
        y = (float*)malloc(sizeof(float) * (size_t)M * N);
        ldy = N;
        if (y == NULL) {
            free(xs);
            return -2;
        }
    }
    if (M > DIRECT_MAX) {
        /* tasks of two panels; a last panel past N keeps its partial sums in spill */
        float* spill = (float*)malloc(sizeof(float) * 16 * (size_t)M);
        if (spill == NULL) {
            free(xs);
            if (glu) free(y);
            return -2;
        }
        const int tasks = (np + 1) / 2;
#pragma omp parallel for schedule(static)
        for (int i = 0; i < tasks; i++) {
            const int p0 = 2 * i, p1 = p0 + 2 < np ? p0 + 2 : np;
            int rc;
#define TB(B, Z, C) rc = task_buffered(x, M, ldx, &q, p0, p1, bias, y, ldy, spill, B, Z, C)
            BY_KIND(TB);
#undef TB
            if (glu && rc == 0) glu_pairs(y, M, N, i, i + 1, out, ldo);
            if (rc != 0) {
#pragma omp atomic write
                failed = 1;
            }
        }
        free(spill);
        free(xs);
        if (glu) free(y);
        return failed ? -2 : 0;
    }
    /* one contiguous run of panels a thread (within a panel of the same share each) */
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        /* (glu: whole pairs a thread) */
        const int u = glu ? 2 : 1, nu = np / u;
        const int p0 = u * (int)((long)nu * t / nt), p1 = u * (int)((long)nu * (t + 1) / nt);
#define TD(B, Z, C) task_direct(x, M, ldx, &q, p0, p1, bias, y, ldy, B, Z, C)
        if (p0 < p1) BY_KIND(TD);
#undef TD
        if (glu && p0 < p1) glu_pairs(y, M, N, p0 / 2, p1 / 2, out, ldo);
    }
    free(xs);
    if (glu) free(y);
    return 0;
#else
    (void)failed;
#pragma omp parallel for schedule(static)
    for (int p = 0; p < np; p++) task_scalar(x, M, ldx, &q, p, p + 1, bias, y, ldy);
    return 0;
#endif
}

/*
 * qgemm_a16: y = x @ dequant(W)^T (+ bias) for an int4 weight with x rounded to int16 per
 * row, the products summed exactly in int32: an AVX2 integer multiply-add (vpmaddwd)
 * takes 16 weights an instruction where the float path widens and converts 8, so one row
 * streams the weight at close to a plain read's speed (no VNNI needed).
 *
 * Each row of x gets one scale sx = absmax / 32767 and xi = round-half-even(x / sx) in
 * -32767..32767, so |x - sx xi| <= sx / 2: the result is within (absmax / 65534) * sum_k
 * |w_nk| (plus float32 rounding) of the exact product with the dequantised weight.
 * Per output and group: d = sum_k xi_k q_nk (int32, exact: |d| <= group * 15 * 32767),
 * t = d - zero * sum_k xi_k (float), total += scale * t over the groups in order; y =
 * sx * total + bias. A row's result does not depend on the rows beside it, and the
 * scalar body (no AVX2) computes the same integers and the same float steps.
 *
 * Layout (model/quant/linear.py packs it): panels of 16 outputs as qgemm_f32's, in pairs
 * of columns: panel p, pair kp (columns 2kp, 2kp + 1) at (p * K / 2 + kp) * 16 bytes; byte
 * 2i holds output i at column 2kp (low nibble) and output i + 8 (high), byte 2i + 1 the
 * same at column 2kp + 1. Unsigned 0..15; scales and zeros [P, K / group, 16] floats. K
 * and group even, group <= 4096 (the int32 sums' bound).
 */
#define A16_MAX_GROUP 4096
#define A16_ROWS 4 /* rows of x sharing each load of the weight */

/* Row x (K floats) as int16 (xi) with its scale; xsum: the int16 values' sum per group.
 * Round half to even, as nearbyintf in the default rounding mode (and cvtps2dq). */
static void a16_row(const float* x, int K, int group, int16_t* xi, float* sx,
                    int32_t* xsum) {
    float amax = 0.0f;
    int k = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 mv = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (; k + 8 <= K; k += 8) mv = _mm256_max_ps(mv, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
    float t8[8];
    _mm256_storeu_ps(t8, mv);
    for (int i = 0; i < 8; i++) amax = t8[i] > amax ? t8[i] : amax;
#endif
    for (; k < K; k++) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
    const float s = amax > 0.0f ? amax / 32767.0f : 1.0f, inv = 1.0f / s;
    *sx = s;
    for (int g = 0; g < K / group; g++) {
        int32_t t = 0;
        k = g * group;
        const int k1 = (g + 1) * group;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 iv = _mm256_set1_ps(inv);
        __m256i tv = _mm256_setzero_si256();
        for (; k + 8 <= k1; k += 8) {
            /* |x * inv| <= 32767 (+ rounding): the conversion and the packing saturate
             * nothing */
            const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), iv));
            tv = _mm256_add_epi32(tv, v);
            const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(v),
                                              _mm256_extracti128_si256(v, 1));
            _mm_storeu_si128((__m128i*)(xi + k), h);
        }
        int32_t t8i[8];
        _mm256_storeu_si256((__m256i*)t8i, tv);
        for (int i = 0; i < 8; i++) t += t8i[i];
#endif
        for (; k < k1; k++) {
            float v = nearbyintf(x[k] * inv);
            v = v > 32767.0f ? 32767.0f : v < -32767.0f ? -32767.0f : v;
            xi[k] = (int16_t)v;
            t += (int16_t)v;
        }
        xsum[g] = t;
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* One column pair into R rows' int32 sums (a[r][0]: outputs 0-7, a[r][1]: 8-15): w0, w1
 * the pair's weights as int16 (lane i: output i's two columns), multiplied-added with
 * each row's two int16 x values at column k (the rows K apart from xg). */
static inline __attribute__((always_inline)) void
madd_pair_rows(__m256i a[][2], __m256i w0, __m256i w1, const int16_t* xg, int K, int k,
               const int R) {
    for (int r = 0; r < R; r++) {
        int32_t pair;
        memcpy(&pair, xg + (size_t)r * K + k, sizeof(pair));
        const __m256i xv = _mm256_set1_epi32(pair);
        a[r][0] = _mm256_add_epi32(a[r][0], _mm256_madd_epi16(w0, xv));
        a[r][1] = _mm256_add_epi32(a[r][1], _mm256_madd_epi16(w1, xv));
    }
}

static inline __attribute__((always_inline)) void
store_pair_sums(int32_t d[][16], const __m256i a[][2], const int R) {
    for (int r = 0; r < R; r++) {
        _mm256_storeu_si256((__m256i*)d[r], a[r][0]);
        _mm256_storeu_si256((__m256i*)(d[r] + 8), a[r][1]);
    }
}
#endif

/* Panel p against R rows of xi (from row m0): each group's int32 sums, then the fold. */
static inline __attribute__((always_inline)) void
a16_panel(const uint8_t* w, int K, int N, int p, const int16_t* xi, const float* sx,
          const int32_t* xsum, int m0, const int R, const float* scales, const float* zeros,
          int group, const float* bias, float* y, int ldy) {
    const int groups = K / group;
    float tot[A16_ROWS][16] = {{0}};
    for (int g = 0; g < groups; g++) {
        int32_t d[A16_ROWS][16];
        const uint8_t* wp = w + ((size_t)p * K + (size_t)g * group) * 8;
        const int16_t* xg = xi + (size_t)m0 * K + (size_t)g * group;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256i m15 = _mm256_set1_epi16(15);
        __m256i a[A16_ROWS][2];
        for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_si256();
        for (int k = 0; k < group; k += 2) {
            if ((k & 7) == 0)
                _mm_prefetch((const char*)wp + (size_t)k * 8 + PF_DIST, _MM_HINT_T0);
            const __m256i b = _mm256_cvtepu8_epi16(
                _mm_loadu_si128((const __m128i*)(wp + (size_t)k * 8)));
            madd_pair_rows(a, _mm256_and_si256(b, m15), _mm256_srli_epi16(b, 4), xg, K, k, R);
        }
        store_pair_sums(d, a, R);
#else
        for (int r = 0; r < R; r++)
            for (int j = 0; j < 16; j++) d[r][j] = 0;
        for (int k = 0; k < group; k += 2) {
            const uint8_t* b = wp + (size_t)k * 8;
            for (int r = 0; r < R; r++) {
                const int32_t x0 = xg[(size_t)r * K + k], x1 = xg[(size_t)r * K + k + 1];
                for (int i = 0; i < 8; i++) {
                    d[r][i] += (b[2 * i] & 15) * x0 + (b[2 * i + 1] & 15) * x1;
                    d[r][i + 8] += (b[2 * i] >> 4) * x0 + (b[2 * i + 1] >> 4) * x1;
                }
            }
        }
#endif
        const size_t si = ((size_t)p * groups + g) * 16;
        for (int r = 0; r < R; r++) {
            const float xs = (float)xsum[(size_t)(m0 + r) * groups + g];
            for (int j = 0; j < 16; j++) {
                const float tj = zeros ? fmaf(-zeros[si + j], xs, (float)d[r][j])
                                       : (float)d[r][j];
                tot[r][j] = fmaf(scales[si + j], tj, tot[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 16 && p * 16 + j < N; j++)
            y[(size_t)(m0 + r) * ldy + p * 16 + j] =
                fmaf(sx[m0 + r], tot[r][j], bias ? bias[p * 16 + j] : 0.0f);
}

/*
 * qgemm_a16_i8: qgemm_a16 for an int8 weight (-128..127, zero points and groups as
 * qgemm_f32's): x rounded to int16 per row as there (the same error bound: within
 * (absmax / 65534) * sum_k |w_nk| plus float32 rounding of the exact product with the
 * dequantised weight), each pair of weights sign-extended to int16 and multiplied-added
 * with vpmaddwd.
 *
 * int32 bound: a pair's product is at most 2 * 128 * 32767 in magnitude, so 256 pairs
 * (I8_BLOCK = 512 columns) sum to at most 2147418112 < 2^31: each group is summed exactly
 * in int32 over blocks of at most 512 columns, each block's sum converted to float and
 * the blocks added in order (t = d_0, t += d_1, ...); then per group, as qgemm_a16: t -=
 * zero * sum of the group's xi, total += scale * t; y = sx * total + bias. Any group
 * size (even) is taken. The scalar body computes the same integers and float steps, and a
 * row's result does not depend on the rows beside it.
 *
 * Layout (model/quant/linear.py pack_pairs_i8): panels of 16 outputs, in pairs of
 * columns: panel p, pair kp (columns 2kp, 2kp + 1) at (p * K / 2 + kp) * 32 bytes, byte
 * 2i + t holding output 16p + i at column 2kp + t. K and group even, group at most
 * 65536.
 */
#define I8_BLOCK 512
#define I8_MAX_GROUP 65536 /* the group's sum of xi (a16_row's int32 xsum) stays exact */

static inline __attribute__((always_inline)) void
a16_i8_panel(const int8_t* w, int K, int N, int p, const int16_t* xi, const float* sx,
             const int32_t* xsum, int m0, const int R, const float* scales,
             const float* zeros, int group, const float* bias, float* y, int ldy) {
    const int groups = K / group;
    float tot[A16_ROWS][16] = {{0}};
    for (int g = 0; g < groups; g++) {
        float t[A16_ROWS][16];
        for (int kb = 0; kb < group; kb += I8_BLOCK) {
            const int kn = group - kb < I8_BLOCK ? group - kb : I8_BLOCK;
            int32_t d[A16_ROWS][16];
            const int8_t* wp = w + ((size_t)p * K + (size_t)g * group + kb) * 16;
            const int16_t* xg = xi + (size_t)m0 * K + (size_t)g * group + kb;
#if defined(__AVX2__) && defined(__FMA__)
            __m256i a[A16_ROWS][2];
            for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_si256();
            for (int k = 0; k < kn; k += 2) {
                if ((k & 3) == 0)
                    _mm_prefetch((const char*)(wp + (size_t)k * 16) + PF_DIST, _MM_HINT_T0);
                const __m256i b0 = _mm256_cvtepi8_epi16(
                    _mm_loadu_si128((const __m128i*)(wp + (size_t)k * 16)));
                const __m256i b1 = _mm256_cvtepi8_epi16(
                    _mm_loadu_si128((const __m128i*)(wp + (size_t)k * 16 + 16)));
                madd_pair_rows(a, b0, b1, xg, K, k, R);
            }
            store_pair_sums(d, a, R);
#else
            for (int r = 0; r < R; r++)
                for (int j = 0; j < 16; j++) d[r][j] = 0;
            for (int k = 0; k < kn; k += 2) {
                const int8_t* b = wp + (size_t)k * 16;
                for (int r = 0; r < R; r++) {
                    const int32_t x0 = xg[(size_t)r * K + k], x1 = xg[(size_t)r * K + k + 1];
                    for (int i = 0; i < 16; i++) d[r][i] += b[2 * i] * x0 + b[2 * i + 1] * x1;
                }
            }
#endif
            for (int r = 0; r < R; r++)
                for (int j = 0; j < 16; j++)
                    t[r][j] = kb ? t[r][j] + (float)d[r][j] : (float)d[r][j];
        }
        const size_t si = ((size_t)p * groups + g) * 16;
        for (int r = 0; r < R; r++) {
            const float xs = (float)xsum[(size_t)(m0 + r) * groups + g];
            for (int j = 0; j < 16; j++) {
                const float tj = zeros ? fmaf(-zeros[si + j], xs, t[r][j]) : t[r][j];
                tot[r][j] = fmaf(scales[si + j], tj, tot[r][j]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 16 && p * 16 + j < N; j++)
            y[(size_t)(m0 + r) * ldy + p * 16 + j] =
                fmaf(sx[m0 + r], tot[r][j], bias ? bias[p * 16 + j] : 0.0f);
}

/* x's int16 copy (xi), its row scales (sx) and group sums (xsum), in one block: the
 * calling thread's, grown as needed and kept, so that a call of a few rows allocates
 * nothing (the OpenMP workers read the caller's block). A call needing more than
 * A16_KEEP bytes gets a block of its own, freed at its end: a long prefill leaves no large
 * buffer behind a thread. */
#define A16_KEEP ((size_t)4 << 20)
static __thread void* a16_scratch = NULL;
static __thread size_t a16_scratch_cap = 0;

/* qgemm_a16 (bits 4) and qgemm_a16_i8 (8): the argument checks, x rounded per row, then
 * one contiguous run of panels a thread, rows A16_ROWS at a time. */
static int a16_gemm(const float* x, int M, int K, int ldx, const void* w, int N,
                    const float* scales, const float* zeros, int group, const float* bias,
                    float* y, int ldy, const int bits) {
    if (M < 0 || N <= 0 || K <= 0 || group <= 0 || K % group || (K | group) & 1
        || group > (bits == 8 ? I8_MAX_GROUP : A16_MAX_GROUP))
        return -1;
    if (M == 0) return 0;
    const int np = (N + 15) / 16, groups = K / group;
    /* sx [M] floats, xsum [M, groups] int32, xi [M, K] int16: 4-byte aligned each */
    const size_t need = sizeof(float) * (size_t)M + sizeof(int32_t) * (size_t)M * groups
                        + sizeof(int16_t) * (size_t)M * K;
    void* own = NULL;
    void* mem;
    if (need <= a16_scratch_cap) {
        mem = a16_scratch;
    } else if (need <= A16_KEEP) {
        free(a16_scratch);
        a16_scratch_cap = 0;
        if ((a16_scratch = malloc(need)) == NULL) return -2;
        a16_scratch_cap = need;
        mem = a16_scratch;
    } else {
        if ((own = mem = malloc(need)) == NULL) return -2;
    }
    float* sx = (float*)mem;
    int32_t* xsum = (int32_t*)(sx + M);
    int16_t* xi = (int16_t*)(xsum + (size_t)M * groups);
    for (int m = 0; m < M; m++)
        a16_row(x + (size_t)m * ldx, K, group, xi + (size_t)m * K, sx + m,
                xsum + (size_t)m * groups);
#pragma omp parallel
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int p0 = (int)((long)np * t / nt), p1 = (int)((long)np * (t + 1) / nt);
        for (int p = p0; p < p1; p++)
            for (int m = 0; m < M; m += A16_ROWS) {
                const int R = M - m < A16_ROWS ? M - m : A16_ROWS;
#define AP(RR)                                                                           \
    do {                                                                                 \
        if (bits == 8)                                                                   \
            a16_i8_panel((const int8_t*)w, K, N, p, xi, sx, xsum, m, RR, scales, zeros,  \
                         group, bias, y, ldy);                                           \
        else                                                                             \
            a16_panel((const uint8_t*)w, K, N, p, xi, sx, xsum, m, RR, scales, zeros,    \
                      group, bias, y, ldy);                                              \
    } while (0)
                if (R == 1) AP(1);
                else if (R == 2) AP(2);
                else if (R == 3) AP(3);
                else AP(4);
#undef AP
            }
    }
    free(own);
    return 0;
}

/* Returns 0, -1 for arguments it does not take, or -2 if memory ran out. */
int qgemm_a16(const float* x, int M, int K, int ldx, const uint8_t* w, int N,
              const float* scales, const float* zeros, int group, const float* bias,
              float* y, int ldy) {
    return a16_gemm(x, M, K, ldx, w, N, scales, zeros, group, bias, y, ldy, 4);
}

/* The same arguments as qgemm_a16 (decode_forward.c calls either through one pointer
 * type). */
int qgemm_a16_i8(const float* x, int M, int K, int ldx, const int8_t* w, int N,
                 const float* scales, const float* zeros, int group, const float* bias,
                 float* y, int ldy) {
    return a16_gemm(x, M, K, ldx, w, N, scales, zeros, group, bias, y, ldy, 8);
}
