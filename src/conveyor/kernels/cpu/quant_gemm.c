/*
 * y = x @ dequant(W)^T (+ bias) for float32 x and an int8 or int4 weight, the weight
 * widened to float32 in registers (never written back dequantised): a decode step reads
 * one or two bytes per weight for 1-32 rows, which is what it is bound by.
 *
 * W is [N, K] integers: bits 8, int8 row-major; bits 4, two per byte along K (the low
 * nibble holds the even k), unsigned 0..15. scales and zeros are [N, K / group] floats;
 * zeros (NULL: none) are subtracted from the integer before the scale, as the checkpoint
 * formats dequantise: w = (q - zero) * scale. Per group and row the products
 * x * (q - zero) are summed in float32 (exact integers times floats), the group's sum is
 * then multiplied by its scale: the same value as x @ w up to float32 rounding and order.
 *
 * Rows are taken four at a time over each weight row (the weight row's bytes converted
 * once per four rows); threads split the output columns.
 */
#include <stdint.h>
#include <stddef.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define ROWS 4

int qgemm_f32_simd(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

static inline float q_at(const uint8_t* wrow, int bits, int k) {
    if (bits == 8) return (float)((const int8_t*)wrow)[k];
    const uint8_t b = wrow[k >> 1];
    return (float)((k & 1) ? (b >> 4) : (b & 15));
}

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 q8_load(const uint8_t* p) {  /* 8 int8 -> 8 floats */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

static inline __m256 q4_load(const uint8_t* p) {  /* 4 bytes = 8 nibbles -> 8 floats */
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

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* rows 0..NR of x against one weight row; NR, BITS and ZERO are constants at each call
 * site (always inlined), so the accumulators stay in registers and the loops unroll. */
static inline __attribute__((always_inline)) void
q_rows_simd(const float* x, int ldx, int K, const uint8_t* wrow, const float* srow,
            const float* zrow, int group, float* out, const int NR, const int BITS,
            const int ZERO) {
    const int groups = K / group;
    __m256 tot0 = _mm256_setzero_ps(), tot1 = tot0, tot2 = tot0, tot3 = tot0;
    for (int g = 0; g < groups; g++) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        const __m256 z = _mm256_set1_ps(ZERO ? zrow[g] : 0.0f);
        const float* xk = x + (size_t)g * group;
        const uint8_t* wk = wrow + (BITS == 8 ? (size_t)g * group : (size_t)g * group / 2);
        for (int k = 0; k < group; k += 8) {
            __m256 w = BITS == 8 ? q8_load(wk + k) : q4_load(wk + (k >> 1));
            if (ZERO) w = _mm256_sub_ps(w, z);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xk + k), w, a0);
            if (NR > 1) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xk + ldx + k), w, a1);
            if (NR > 2) a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 2 * (size_t)ldx + k), w, a2);
            if (NR > 3) a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xk + 3 * (size_t)ldx + k), w, a3);
        }
        const __m256 s = _mm256_set1_ps(srow[g]);
        tot0 = _mm256_fmadd_ps(a0, s, tot0);
        if (NR > 1) tot1 = _mm256_fmadd_ps(a1, s, tot1);
        if (NR > 2) tot2 = _mm256_fmadd_ps(a2, s, tot2);
        if (NR > 3) tot3 = _mm256_fmadd_ps(a3, s, tot3);
    }
    out[0] = hsum(tot0);
    if (NR > 1) out[1] = hsum(tot1);
    if (NR > 2) out[2] = hsum(tot2);
    if (NR > 3) out[3] = hsum(tot3);
}

/* One group (a scale per output row) and no zero point: eight rows a pass, the sums
 * scaled once at the end (eight accumulators, the weight converted once per 8 rows). */
static inline __attribute__((always_inline)) void
q_rows8_channel(const float* x, int ldx, int K, const uint8_t* wrow, float scale,
                float* out, const int BITS) {
    __m256 a[8];
    for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 8) {
        const __m256 w = BITS == 8 ? q8_load(wrow + k) : q4_load(wrow + (k >> 1));
        for (int r = 0; r < 8; r++)
            a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (size_t)r * ldx + k), w, a[r]);
    }
    for (int r = 0; r < 8; r++) out[r] = hsum(a[r]) * scale;
}

#define Q_ROWS_CASE(BITS, ZERO)                                                          \
    switch (nr) {                                                                        \
    case 1: q_rows_simd(x, ldx, K, wrow, srow, zrow, group, out, 1, BITS, ZERO); break;  \
    case 2: q_rows_simd(x, ldx, K, wrow, srow, zrow, group, out, 2, BITS, ZERO); break;  \
    case 3: q_rows_simd(x, ldx, K, wrow, srow, zrow, group, out, 3, BITS, ZERO); break;  \
    default: q_rows_simd(x, ldx, K, wrow, srow, zrow, group, out, 4, BITS, ZERO); break; \
    }
#endif

/* rows r0..r0+nr (nr <= ROWS) of x against weight row n */
static void q_rows(const float* x, int ldx, int nr, int K, const uint8_t* wrow, int bits,
                   const float* srow, const float* zrow, int group, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
    if (group % 8 == 0) {
        if (bits == 8 && zrow) { Q_ROWS_CASE(8, 1) }
        else if (bits == 8) { Q_ROWS_CASE(8, 0) }
        else if (zrow) { Q_ROWS_CASE(4, 1) }
        else { Q_ROWS_CASE(4, 0) }
        return;
    }
#endif
    const int groups = K / group;
    for (int r = 0; r < nr; r++) {
        const float* xr = x + (size_t)r * ldx;
        float tot = 0.0f;
        for (int g = 0; g < groups; g++) {
            const float z = zrow ? zrow[g] : 0.0f;
            float acc = 0.0f;
            for (int k = g * group; k < (g + 1) * group; k++)
                acc += xr[k] * (q_at(wrow, bits, k) - z);
            tot += acc * srow[g];
        }
        out[r] = tot;
    }
}

/* Returns 0, or -1 for arguments it does not take. */
int qgemm_f32(const float* x, int M, int K, int ldx, const void* w, int bits, int N,
              const float* scales, const float* zeros, int group, const float* bias,
              float* y, int ldy) {
    if (M < 0 || N <= 0 || K <= 0 || group <= 0 || K % group || (bits != 8 && bits != 4)
        || (bits == 4 && K % 2))
        return -1;
    const int groups = K / group;
    const size_t wstride = bits == 8 ? (size_t)K : (size_t)K / 2;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t* wrow = (const uint8_t*)w + n * wstride;
        const float* srow = scales + (size_t)n * groups;
        const float* zrow = zeros ? zeros + (size_t)n * groups : NULL;
        int r0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
        if (groups == 1 && !zrow && K % 8 == 0) {
            for (; r0 + 8 <= M; r0 += 8) {
                float out[8];
                if (bits == 8) q_rows8_channel(x + (size_t)r0 * ldx, ldx, K, wrow, srow[0], out, 8);
                else q_rows8_channel(x + (size_t)r0 * ldx, ldx, K, wrow, srow[0], out, 4);
                for (int r = 0; r < 8; r++)
                    y[(size_t)(r0 + r) * ldy + n] = out[r] + (bias ? bias[n] : 0.0f);
            }
        }
#endif
        for (; r0 < M; r0 += ROWS) {
            const int nr = M - r0 < ROWS ? M - r0 : ROWS;
            float out[ROWS];
            q_rows(x + (size_t)r0 * ldx, ldx, nr, K, wrow, bits, srow, zrow, group, out);
            for (int r = 0; r < nr; r++)
                y[(size_t)(r0 + r) * ldy + n] = out[r] + (bias ? bias[n] : 0.0f);
        }
    }
    return 0;
}
