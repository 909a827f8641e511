/*
 * y = x @ dequant(W)^T (+ bias) for float32 x and an int8 or int4 weight, the weight
 * widened to float32 in registers or in a small per-thread buffer (never a float copy of
 * the whole weight): a decode step reads one or half a byte per weight, which is what it
 * is bound by at a few rows.
 *
 * W is [N, K] integers: bits 8, int8 row-major; bits 4, two per byte along K (the low
 * nibble holds the even k), unsigned 0..15. scales and zeros are [N, K / group] floats;
 * zeros (NULL: none) are subtracted from the integer before the scale, as the checkpoint
 * formats dequantise: w = (q - zero) * scale.
 *
 * The value multiplied by x: with one group per row (a scale per output row), q - zero
 * (exact for an integer zero), the row's sum then multiplied by its scale once; with
 * groups, (q - zero) * scale rounded to float32, as the dequantised float32 weight holds
 * it. Each output is one float32 FMA chain per 8-lane slot over k ascending, the 8 slots
 * then summed in one fixed order (hsum4): the same bits whichever path below computes it
 * and however many rows the call has.
 *
 * Threads split the output columns in tasks of NB weight rows. Up to DIRECT_MAX rows of x
 * the weights are widened in registers, four weight rows a pass sharing each load of x
 * (four independent FMA chains a row: one chain waited on the FMA latency, not memory).
 * From DIRECT_MAX + 1 rows a task widens its NB rows once into a float buffer (L1/L2)
 * and register tiles of TR rows x TC weight rows run over it: the widening is paid once
 * per weight, not once per few rows.
 */
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define NB 12        /* weight rows a task owns: a multiple of DC and TC */
#define DC 4         /* weight rows a direct pass widens in registers */
#define DIRECT_MAX 2 /* rows of x up to which the weights are widened in registers */
#define TR 4         /* buffered tile: rows of x ... */
#define TC 3         /* ... by weight rows (12 accumulators) */
/* Bytes ahead of where a pass reads the weight that it prefetches. A task's weight rows
 * are one contiguous block, read a few rows at a time; a row is a few cache lines (576
 * bytes at K = 576, int8), too short a stream for the hardware prefetcher to ramp up on,
 * so without it every pass waited on its rows' first lines: 6.7 against 23 GB/s on one
 * core of the Zen 3 machine (benchmarks/kernels/quant_rows.py measures it in place). */
#define PF_DIST 4096

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
    size_t wstride;
    int bits, K, group, groups, chan;
    const float* scales;
    const float* zeros;
} QW;

static inline float q_at(const uint8_t* wrow, int bits, int k) {
    if (bits == 8) return (float)((const int8_t*)wrow)[k];
    const uint8_t b = wrow[k >> 1];
    return (float)((k & 1) ? (b >> 4) : (b & 15));
}

/* The value x[k] is multiplied by for weight row n (see above). */
static inline float w_at(const QW* q, int n, int k) {
    const int g = k / q->group;
    float v = q_at(q->w + (size_t)n * q->wstride, q->bits, k);
    if (q->zeros) v -= q->zeros[(size_t)n * q->groups + g];
    return q->chan ? v : v * q->scales[(size_t)n * q->groups + g];
}

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 q8_load(const uint8_t* p) { /* 8 int8 -> 8 floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

static inline __m256 q4_load(const uint8_t* p) { /* 4 bytes = 8 nibbles -> 8 floats */
    int32_t word;
    __builtin_memcpy(&word, p, 4);
    const __m128i dup = _mm_shuffle_epi8(_mm_cvtsi32_si128(word),
                                         _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1,
                                                       -1, -1, -1, -1, -1));
    __m256i v = _mm256_cvtepu8_epi32(dup);
    v = _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
    v = _mm256_and_si256(v, _mm256_set1_epi32(15));
    return _mm256_cvtepi32_ps(v);
}

/* The 8 slots of each of a, b, c, d summed, ((0+1)+(2+3))+((4+5)+(6+7)): the same order
 * for each of the four. */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* Eight weights of one row at k (in group g) as the kernel multiplies them. */
static inline __attribute__((always_inline)) __m256
deq8(const uint8_t* row, int k, __m256 s, __m256 z, const int BITS, const int ZERO,
     const int CHAN) {
    __m256 v = BITS == 8 ? q8_load(row + k) : q4_load(row + (k >> 1));
    if (ZERO) v = _mm256_sub_ps(v, z);
    return CHAN ? v : _mm256_mul_ps(v, s);
}

/* The R x C sums of a tile (acc[r][c]) as floats, row-major with row length C. */
static inline __attribute__((always_inline)) void
reduce_tile(__m256 acc[][4], const int R, const int C, float* out) {
    for (int r = 0; r < R; r++) {
        const __m256 zero = _mm256_setzero_ps();
        float t[4];
        _mm_storeu_ps(t, hsum4(acc[r][0], C > 1 ? acc[r][1] : zero, C > 2 ? acc[r][2] : zero,
                               C > 3 ? acc[r][3] : zero));
        for (int c = 0; c < C; c++) out[r * C + c] = t[c];
    }
}

/* R (1..DIRECT_MAX) rows of x against C (1..DC) weight rows from n, widened in
 * registers; out: R x C sums. */
static inline __attribute__((always_inline)) void
direct_tile(const float* x, int ldx, const QW* q, int n, const int R, const int C,
            const int BITS, const int ZERO, const int CHAN, float* out) {
    __m256 acc[DIRECT_MAX][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    const uint8_t* rows[DC];
    for (int c = 0; c < C; c++) rows[c] = q->w + (size_t)(n + c) * q->wstride;
    const char* pf = (const char*)rows[0] + PF_DIST;
    const size_t STEP = (size_t)C * (BITS == 8 ? 8 : 4); /* weight bytes a k step reads */
    size_t done = 0;
    for (int g = 0; g < q->groups; g++) {
        __m256 s[DC], z[DC];
        for (int c = 0; c < C; c++) {
            const size_t i = (size_t)(n + c) * q->groups + g;
            s[c] = CHAN ? _mm256_setzero_ps() : _mm256_broadcast_ss(q->scales + i);
            z[c] = ZERO ? _mm256_broadcast_ss(q->zeros + i) : _mm256_setzero_ps();
        }
        const int k1 = (g + 1) * q->group;
        for (int k = g * q->group; k < k1; k += 8) {
            /* one line PF_DIST ahead for every 64 bytes this pass has read (the C rows
             * are contiguous; past the weight's end a prefetch does not fault) */
            if ((done & 63) < STEP) _mm_prefetch(pf + done, _MM_HINT_T0);
            done += STEP;
            __m256 w[DC];
            for (int c = 0; c < C; c++) w[c] = deq8(rows[c], k, s[c], z[c], BITS, ZERO, CHAN);
            for (int r = 0; r < R; r++) {
                const __m256 xv = _mm256_loadu_ps(x + (size_t)r * ldx + k);
                for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, w[c], acc[r][c]);
            }
        }
    }
    reduce_tile(acc, R, C, out);
}

/* Weight rows n..n+nn widened into buf (nn rows of K floats, the values direct_tile
 * widens in registers). */
static inline __attribute__((always_inline)) void
widen_rows(const QW* q, int n, int nn, float* buf, const int BITS, const int ZERO,
           const int CHAN) {
    for (int j = 0; j < nn; j++) {
        const uint8_t* row = q->w + (size_t)(n + j) * q->wstride;
        float* dst = buf + (size_t)j * q->K;
        for (int g = 0; g < q->groups; g++) {
            const size_t i = (size_t)(n + j) * q->groups + g;
            const __m256 s = CHAN ? _mm256_setzero_ps() : _mm256_broadcast_ss(q->scales + i);
            const __m256 z = ZERO ? _mm256_broadcast_ss(q->zeros + i) : _mm256_setzero_ps();
            const int k1 = (g + 1) * q->group;
            for (int k = g * q->group; k < k1; k += 8) {
                const int byte = BITS == 8 ? k : k >> 1; /* the rows are contiguous */
                if (byte % 64 == 0) _mm_prefetch((const char*)row + byte + PF_DIST, _MM_HINT_T0);
                _mm256_store_ps(dst + k, deq8(row, k, s, z, BITS, ZERO, CHAN));
            }
        }
    }
}

/* R (1..TR) rows of x against C (1..TC) widened weight rows (buf, rows K apart). */
static inline __attribute__((always_inline)) void
buffer_tile(const float* x, int ldx, const float* buf, int K, const int R, const int C,
            float* out) {
    __m256 acc[TR][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 8) {
        __m256 w[TC];
        for (int c = 0; c < C; c++) w[c] = _mm256_load_ps(buf + (size_t)c * K + k);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_loadu_ps(x + (size_t)r * ldx + k);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, w[c], acc[r][c]);
        }
    }
    reduce_tile(acc, R, C, out);
}

/* The R x C sums into y (scale for one group a row, then bias). */
static inline void store_tile(const float* t, int R, int C, const QW* q, int n,
                              const float* bias, float* y, int ldy) {
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float v = t[r * C + c];
            if (q->chan) v *= q->scales[(size_t)(n + c) * q->groups];
            y[(size_t)r * ldy + n + c] = v + (bias ? bias[n + c] : 0.0f);
        }
}

#define DIRECT_C(R, BITS, ZERO, CHAN)                                                   \
    switch (C) {                                                                        \
    case 1: direct_tile(xr, ldx, q, n, R, 1, BITS, ZERO, CHAN, t); break;                \
    case 2: direct_tile(xr, ldx, q, n, R, 2, BITS, ZERO, CHAN, t); break;                \
    case 3: direct_tile(xr, ldx, q, n, R, 3, BITS, ZERO, CHAN, t); break;                \
    default: direct_tile(xr, ldx, q, n, R, 4, BITS, ZERO, CHAN, t); break;               \
    }

/* Rows 0..M of x against weight rows n0..n1, widened in registers. */
static inline __attribute__((always_inline)) void
task_direct(const float* x, int M, int ldx, const QW* q, int n0, int n1,
            const float* bias, float* y, int ldy, const int BITS, const int ZERO,
            const int CHAN) {
    for (int n = n0; n < n1; n += DC) {
        const int C = n1 - n < DC ? n1 - n : DC;
        for (int m = 0; m < M; m += DIRECT_MAX) {
            const int R = M - m < DIRECT_MAX ? M - m : DIRECT_MAX;
            const float* xr = x + (size_t)m * ldx;
            float t[DIRECT_MAX * DC];
            if (R == 1) { DIRECT_C(1, BITS, ZERO, CHAN) }
            else { DIRECT_C(2, BITS, ZERO, CHAN) }
            store_tile(t, R, C, q, n, bias, y + (size_t)m * ldy, ldy);
        }
    }
}

#define BUFFER_C(R)                                                                     \
    switch (C) {                                                                        \
    case 1: buffer_tile(xr, ldx, b, q->K, R, 1, t); break;                              \
    case 2: buffer_tile(xr, ldx, b, q->K, R, 2, t); break;                              \
    default: buffer_tile(xr, ldx, b, q->K, R, 3, t); break;                             \
    }

/* Rows 0..M of x against weight rows n0..n1 (at most NB), widened once into buf. */
static void task_buffered(const float* x, int M, int ldx, const QW* q, int n0, int n1,
                          const float* bias, float* y, int ldy, float* buf) {
    const int nn = n1 - n0;
    const int z = q->zeros != NULL;
    if (q->bits == 8) {
        if (q->chan) { if (z) widen_rows(q, n0, nn, buf, 8, 1, 1); else widen_rows(q, n0, nn, buf, 8, 0, 1); }
        else { if (z) widen_rows(q, n0, nn, buf, 8, 1, 0); else widen_rows(q, n0, nn, buf, 8, 0, 0); }
    } else {
        if (q->chan) { if (z) widen_rows(q, n0, nn, buf, 4, 1, 1); else widen_rows(q, n0, nn, buf, 4, 0, 1); }
        else { if (z) widen_rows(q, n0, nn, buf, 4, 1, 0); else widen_rows(q, n0, nn, buf, 4, 0, 0); }
    }
    for (int m = 0; m < M; m += TR) {
        const int R = M - m < TR ? M - m : TR;
        const float* xr = x + (size_t)m * ldx;
        for (int n = n0; n < n1; n += TC) {
            const int C = n1 - n < TC ? n1 - n : TC;
            const float* b = buf + (size_t)(n - n0) * q->K;
            float t[TR * TC];
            switch (R) {
            case 1: BUFFER_C(1) break;
            case 2: BUFFER_C(2) break;
            case 3: BUFFER_C(3) break;
            default: BUFFER_C(4) break;
            }
            store_tile(t, R, C, q, n, bias, y + (size_t)m * ldy, ldy);
        }
    }
}

/* The calling thread's widening buffer (NB rows of K floats), grown as needed. */
static __thread float* wide_buf = NULL;
static __thread size_t wide_len = 0;

static float* widen_buffer(size_t floats) {
    if (floats > wide_len) {
        free(wide_buf);
        wide_buf = (float*)aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
        wide_len = wide_buf ? floats : 0;
    }
    return wide_buf;
}
#endif

/* Rows 0..M of x against weight rows n0..n1, one output at a time (any group size). */
static void task_scalar(const float* x, int M, int ldx, const QW* q, int n0, int n1,
                        const float* bias, float* y, int ldy) {
    for (int n = n0; n < n1; n++)
        for (int m = 0; m < M; m++) {
            const float* xr = x + (size_t)m * ldx;
            float acc = 0.0f;
            for (int k = 0; k < q->K; k++) acc += xr[k] * w_at(q, n, k);
            if (q->chan) acc *= q->scales[(size_t)n * q->groups];
            y[(size_t)m * ldy + n] = acc + (bias ? bias[n] : 0.0f);
        }
}

/* Returns 0, -1 for arguments it does not take, or -2 if memory ran out. */
int qgemm_f32(const float* x, int M, int K, int ldx, const void* w, int bits, int N,
              const float* scales, const float* zeros, int group, const float* bias,
              float* y, int ldy) {
    if (M < 0 || N <= 0 || K <= 0 || group <= 0 || K % group || (bits != 8 && bits != 4)
        || (bits == 4 && K % 2))
        return -1;
    const QW q = {(const uint8_t*)w, bits == 8 ? (size_t)K : (size_t)K / 2, bits, K, group,
                  K / group, K == group, scales, zeros};
    const int tasks = (N + NB - 1) / NB;
    int failed = 0;
#pragma omp parallel for schedule(static)
    for (int i = 0; i < tasks; i++) {
        const int n0 = i * NB, n1 = n0 + NB < N ? n0 + NB : N;
#if defined(__AVX2__) && defined(__FMA__)
        if (group % 8 == 0) {
            if (M > DIRECT_MAX) {
                float* buf = widen_buffer((size_t)NB * K);
                if (buf != NULL) {
                    task_buffered(x, M, ldx, &q, n0, n1, bias, y, ldy, buf);
                    continue;
                }
#pragma omp atomic write
                failed = 1;
                continue;
            }
            const int z = zeros != NULL;
            if (bits == 8) {
                if (q.chan) { if (z) task_direct(x, M, ldx, &q, n0, n1, bias, y, ldy, 8, 1, 1); else task_direct(x, M, ldx, &q, n0, n1, bias, y, ldy, 8, 0, 1); }
                else { if (z) task_direct(x, M, ldx, &q, n0, n1, bias, y, ldy, 8, 1, 0); else task_direct(x, M, ldx, &q, n0, n1, bias, y, ldy, 8, 0, 0); }
            } else {
                if (q.chan) { if (z) task_direct(x, M, ldx, &q, n0, n1, bias, y, ldy, 4, 1, 1); else task_direct(x, M, ldx, &q, n0, n1, bias, y, ldy, 4, 0, 1); }
                else { if (z) task_direct(x, M, ldx, &q, n0, n1, bias, y, ldy, 4, 1, 0); else task_direct(x, M, ldx, &q, n0, n1, bias, y, ldy, 4, 0, 0); }
            }
            continue;
        }
#endif
        task_scalar(x, M, ldx, &q, n0, n1, bias, y, ldy);
    }
    return failed ? -2 : 0;
}
