/*
 * out = x @ W^T (+ bias), float32, with W packed once at load time; optionally the
 * SwiGLU activation fused into the epilogue of a packed gate/up projection.
 *
 * The structure is the classic one of BLIS and GotoBLAS: a 6x16 register tile (12 ymm
 * accumulators; a K step is two loads of W, six broadcasts of x and twelve FMAs), W in
 * panels of 16 output columns that are K-contiguous (a panel's KC x 16 slice stays in L1
 * while every 6-row sliver of an MC-row block of x passes over it), tiles of MC rows x
 * NCP panels handed to threads dynamically. Unlike BLIS, x is not packed: a tile
 * broadcasts its six rows' elements from x itself (six sequential streams the hardware
 * prefetcher follows), which skips a transposing pass over x per call and its barrier:
 * 1.03x over the packed form on a 2,048-token step's projections, 1.04-1.10x where K is
 * 1,024-4,096 (rows 4 KB apart included), on the Zen 4 class. It needs AVX2 + FMA
 * (the loader only builds it where -march=native has them). Where the build has AVX-512
 * (-march=native on such a CPU), a panel row is one zmm register and the tiles keep one
 * zmm accumulator per row and panel (6 a tile; 1-4 rows over up to 8 panels): the same
 * FMAs per output in the same order, so both bodies give the same bits (tested across
 * the builds). A last sliver of 1-4 rows goes through the few-row tiles too.
 *
 * Why not oneDNN (which torch bundles and which a packed nn.Linear used before): on the
 * 2-core AVX2 machine this project measures on, this kernel runs the model's prefill
 * projections 5-10% faster, and owning the epilogue lets the gate/up projection write
 * silu(gate) * up straight from registers instead of a [T, 2I] intermediate that a
 * separate pass reads back (25 MB per layer for a 2,048-token step of SmolLM2-135M).
 *
 * Packed layouts (floats, 64-byte aligned by the caller):
 *   plain    panel p, k: W[p * 16 + j][k] for j < 16 at ((p * K) + k) * 16 + j (zeros past N)
 *   gate/up  panel p holds gate rows 8p..8p+7 then up rows 8p..8p+7 (W = [gate; up] of
 *            2I rows), so one tile has both halves of 8 outputs
 *
 * The same layouts hold bf16 weights (uint16 elements, 32-byte panel rows): gemm_f32_w16
 * widens each to float32 as it loads it (a bf16 is the top half of a float32, so exactly)
 * and then runs the same FMAs in the same order: bit for bit what gemm_f32 gives on the
 * widened weight, for half the bytes read. A decode step reads every weight once from
 * memory, so a bfloat16 checkpoint computed in float32 (CPUs without bf16 arithmetic)
 * streams its own bytes instead of a float32 copy twice their size.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MR 6
#define NR 16
#define KC_MAX 288 /* a 288 x 16 slice of a W panel is 18 KB: inside a 32 KB L1 */
#define MC 144     /* a 144 x 288 block of x is 162 KB: inside a 512 KB L2 */

int64_t gemm_packed_size(int N, int K, int gate_up) {
    const int np = gate_up ? (N / 2 + 7) / 8 : (N + NR - 1) / NR;
    return (int64_t)np * K * NR;
}

/* The packing loop for float32 or bf16 (uint16) weights: the same layout, element for
 * element. */
#define DEFINE_PACK(NAME, T)                                                              \
void NAME(const T* w, T* packed, int N, int K, int gate_up) {                             \
    const int np = gate_up ? (N / 2 + 7) / 8 : (N + NR - 1) / NR;                         \
    const int inter = N / 2;                                                              \
    _Pragma("omp parallel for schedule(static)")                                          \
    for (int p = 0; p < np; p++)                                                          \
        for (int j = 0; j < NR; j++) {                                                    \
            int row;                                                                      \
            if (gate_up) {                                                                \
                const int o = p * 8 + (j & 7);                                            \
                row = o < inter ? (j < 8 ? o : inter + o) : -1;                           \
            } else {                                                                      \
                row = p * NR + j < N ? p * NR + j : -1;                                   \
            }                                                                             \
            T* dst = packed + (int64_t)p * K * NR + j;                                    \
            for (int k = 0; k < K; k++)                                                   \
                dst[(int64_t)k * NR] = row >= 0 ? w[(int64_t)row * K + k] : (T)0;         \
        }                                                                                 \
}

DEFINE_PACK(gemm_pack_weight_f32, float)
DEFINE_PACK(gemm_pack_weight_bf16, uint16_t)

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "simd_math.h"

int gemm_f32_available(void) { return 1; }

/* silu(g) * u = g / (1 + e^-g) * u; the exponent is clamped so that it stays finite, as
 * -ffast-math assumes (silu(g < -80) ~ 0). */
static inline __m256 silu_mul256(__m256 g, __m256 u) {
    const __m256 e = exp256(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g),
                                          _mm256_set1_ps(80.f)));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), u);
}

/* The last K block's epilogue for one tile: bias, then either a plain store of the nr
 * valid columns or silu(gate) * up for the nr valid outputs. */
static void finish_tile(float acc[MR][NR], int mr, int nr, const float* bias, int gate_up,
                        float* out, int ldo) {
    if (bias != NULL) /* plain panels only */
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < nr; j++) acc[r][j] += bias[j];
    for (int r = 0; r < mr; r++) {
        float* o = out + (int64_t)r * ldo;
        if (gate_up) {
            float res[8] __attribute__((aligned(32)));
            _mm256_store_ps(res, silu_mul256(_mm256_loadu_ps(acc[r]), _mm256_loadu_ps(acc[r] + 8)));
            if (nr == 8) memcpy(o, res, sizeof(res));
            else for (int j = 0; j < nr; j++) o[j] = res[j];
        } else if (nr == NR) {
            memcpy(o, acc[r], sizeof(float) * NR);
        } else {
            for (int j = 0; j < nr; j++) o[j] = acc[r][j];
        }
    }
}

/*
 * One 6x16 tile over kc steps of K. part: where partial sums live between K blocks
 * (loaded first when accumulate). last: this is the final K block, so the tile goes
 * through the epilogue into out instead of back to part.
 */
/* A bf16 panel row's 8 values from p (16-byte aligned), widened to float32: exact. */
static inline __m256 load_bf16x8(const uint16_t* p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_load_si128((const __m128i*)p)), 16));
}

#if defined(__AVX512F__)
/* With AVX-512 a 16-column panel row is one zmm register: the tiles below keep one zmm
 * accumulator per row and panel where the AVX2 body keeps two ymm ones. Each output is
 * still one FMA per k, k ascending, so both bodies give the same bits. */
static inline __m512 load_bf16x16(const uint16_t* p) { /* p 32-byte aligned */
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_load_si256((const __m256i*)p)), 16));
}

/* A zmm accumulator as the two ymm halves the shared epilogue takes. */
static inline void split_zmm(__m512 v, __m256 halves[2]) {
    halves[0] = _mm512_castps512_ps256(v);
    halves[1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

#define TILE_FMAS512()                                                       \
    do {                                                                     \
        z0 = _mm512_fmadd_ps(_mm512_set1_ps(a0[k]), b, z0);                  \
        z1 = _mm512_fmadd_ps(_mm512_set1_ps(a1[k]), b, z1);                  \
        z2 = _mm512_fmadd_ps(_mm512_set1_ps(a2[k]), b, z2);                  \
        z3 = _mm512_fmadd_ps(_mm512_set1_ps(a3[k]), b, z3);                  \
        z4 = _mm512_fmadd_ps(_mm512_set1_ps(a4[k]), b, z4);                  \
        z5 = _mm512_fmadd_ps(_mm512_set1_ps(a5[k]), b, z5);                  \
    } while (0)
#endif

/* The twelve FMAs of one K step, b0/b1 the panel row's two halves. */
#define TILE_FMAS()                                                          \
    do {                                                                     \
        __m256 x = _mm256_broadcast_ss(a0 + k);                              \
        c00 = _mm256_fmadd_ps(x, b0, c00); c01 = _mm256_fmadd_ps(x, b1, c01); \
        x = _mm256_broadcast_ss(a1 + k);                                     \
        c10 = _mm256_fmadd_ps(x, b0, c10); c11 = _mm256_fmadd_ps(x, b1, c11); \
        x = _mm256_broadcast_ss(a2 + k);                                     \
        c20 = _mm256_fmadd_ps(x, b0, c20); c21 = _mm256_fmadd_ps(x, b1, c21); \
        x = _mm256_broadcast_ss(a3 + k);                                     \
        c30 = _mm256_fmadd_ps(x, b0, c30); c31 = _mm256_fmadd_ps(x, b1, c31); \
        x = _mm256_broadcast_ss(a4 + k);                                     \
        c40 = _mm256_fmadd_ps(x, b0, c40); c41 = _mm256_fmadd_ps(x, b1, c41); \
        x = _mm256_broadcast_ss(a5 + k);                                     \
        c50 = _mm256_fmadd_ps(x, b0, c50); c51 = _mm256_fmadd_ps(x, b1, c51); \
    } while (0)

/* Prefetch line i of pf into L2 (not L1: the slice being computed on fills most of it).
 * A tile's K loop issues one such line a step for its first npf steps. */
static inline void prefetch_line(const char* pf, int i) {
    _mm_prefetch(pf + (int64_t)i * 64, _MM_HINT_T1);
}

/* A tile's epilogue: acc (rows past mr are ignored) into part, or through bias and the
 * activation into out on the last K block. */
static inline __attribute__((always_inline)) void tile_store(
        const __m256 acc[MR][2], float* part, int ldp, int accumulate, int last, int mr,
        int nr, const float* bias, int gate_up, float* out, int ldo) {
    /* A full tile's partial sums, and a plain full tile without bias, are stored from
     * registers (a plain product keeps its partial sums in out: part == out); the rest
     * goes through a small array. */
    const int pcols = gate_up ? NR : nr;
    if (mr == MR && pcols == NR && (!last || (!gate_up && bias == NULL))) {
        for (int r = 0; r < MR; r++) {
            float* p = part + (int64_t)r * ldp;
            __m256 v0 = acc[r][0], v1 = acc[r][1];
            if (accumulate) {
                v0 = _mm256_add_ps(v0, _mm256_loadu_ps(p));
                v1 = _mm256_add_ps(v1, _mm256_loadu_ps(p + 8));
            }
            _mm256_storeu_ps(p, v0);
            _mm256_storeu_ps(p + 8, v1);
        }
        return;
    }
    if (last && gate_up && mr == MR && nr == 8 && bias == NULL) {
        /* A full gate/up tile: SwiGLU in registers, 8 outputs a row. */
        for (int r = 0; r < MR; r++) {
            __m256 g = acc[r][0], u = acc[r][1];
            if (accumulate) {
                g = _mm256_add_ps(g, _mm256_loadu_ps(part + (int64_t)r * ldp));
                u = _mm256_add_ps(u, _mm256_loadu_ps(part + (int64_t)r * ldp + 8));
            }
            _mm256_storeu_ps(out + (int64_t)r * ldo, silu_mul256(g, u));
        }
        return;
    }
    float t[MR][NR] __attribute__((aligned(32)));
    for (int r = 0; r < MR; r++) {
        _mm256_store_ps(t[r], acc[r][0]);
        _mm256_store_ps(t[r] + 8, acc[r][1]);
    }
    if (accumulate)
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < pcols; j++) t[r][j] += part[(int64_t)r * ldp + j];
    if (last) {
        finish_tile(t, mr, nr, bias, gate_up, out, ldo);
    } else {
        for (int r = 0; r < mr; r++)
            for (int j = 0; j < pcols; j++) part[(int64_t)r * ldp + j] = t[r][j];
    }
}

/* a: the sliver's first row of x at this K block's first column, rows lda apart (rows
 * past mr read row 0 again: their sums are never stored). wbf16: wp holds uint16 bf16
 * weights (else floats); the branch is per tile, outside the K loop, and both loops run
 * the same FMAs in the same order. pf, npf: the lines of the next weight slice this tile
 * prefetches (npf <= 0: none). */
static inline void tile_6x16(int kc, const float* a, int lda, const void* restrict wp,
                             int wbf16, float* part, int ldp, int accumulate, int last,
                             int mr, int nr, const float* bias, int gate_up, float* out,
                             int ldo, const char* pf, int npf) {
    const float* restrict a0 = a;
    const float* restrict a1 = mr > 1 ? a + (int64_t)lda : a;
    const float* restrict a2 = mr > 2 ? a + 2 * (int64_t)lda : a;
    const float* restrict a3 = mr > 3 ? a + 3 * (int64_t)lda : a;
    const float* restrict a4 = mr > 4 ? a + 4 * (int64_t)lda : a;
    const float* restrict a5 = mr > 5 ? a + 5 * (int64_t)lda : a;
#if defined(__AVX512F__)
    __m512 z0 = _mm512_setzero_ps(), z1 = z0, z2 = z0, z3 = z0, z4 = z0, z5 = z0;
    if (wbf16) {
        const uint16_t* restrict bb = (const uint16_t*)wp;
        for (int k = 0; k < kc; k++, bb += NR) {
            if (k < npf) prefetch_line(pf, k);
            const __m512 b = load_bf16x16(bb);
            TILE_FMAS512();
        }
    } else {
        const float* restrict bb = (const float*)wp;
        for (int k = 0; k < kc; k++, bb += NR) {
            if (k < npf) prefetch_line(pf, k);
            const __m512 b = _mm512_load_ps(bb);
            TILE_FMAS512();
        }
    }
    __m256 acc[MR][2];
    split_zmm(z0, acc[0]); split_zmm(z1, acc[1]); split_zmm(z2, acc[2]);
    split_zmm(z3, acc[3]); split_zmm(z4, acc[4]); split_zmm(z5, acc[5]);
    tile_store(acc, part, ldp, accumulate, last, mr, nr, bias, gate_up, out, ldo);
#else
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
           c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    if (wbf16) {
        const uint16_t* restrict b = (const uint16_t*)wp;
        for (int k = 0; k < kc; k++, b += NR) {
            if (k < npf) prefetch_line(pf, k);
            const __m256 b0 = load_bf16x8(b), b1 = load_bf16x8(b + 8);
            TILE_FMAS();
        }
    } else {
        const float* restrict b = (const float*)wp;
        for (int k = 0; k < kc; k++, b += NR) {
            if (k < npf) prefetch_line(pf, k);
            const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
            TILE_FMAS();
        }
    }
    const __m256 acc[MR][2] = {{c00, c01}, {c10, c11}, {c20, c21},
                               {c30, c31}, {c40, c41}, {c50, c51}};
    tile_store(acc, part, ldp, accumulate, last, mr, nr, bias, gate_up, out, ldo);
#endif
}

/*
 * ROWS (1-4) rows of x over P panels at once (P consecutive panels, K * NR elements
 * apart). A 6-row tile with one valid row does six rows' FMAs and waits on two FMA
 * chains' latency per K step; here a decode row costs its own FMAs, P x 2 independent
 * chains. Each output is the same sum in the same order as in tile_6x16 (k ascending,
 * one FMA each), so a row's result does not depend on how many rows share its sliver.
 */
static inline __attribute__((always_inline)) void tile_few(
        const int ROWS, const int P, int kc, const float* restrict a, int lda,
        const void* restrict wp,
        int64_t panel_stride, int wbf16, float* part, int ldp, int part_step, int accumulate,
        int last, int mr, const int* nrs, const float* bias, int gate_up, float* out,
        int ldo, int cols, const char* pf) {
    /* pf: the weight slice read next (P panels, panel_stride apart), or NULL; step k
     * prefetches its row k of each panel: one slice ahead, the few rows' FMAs too few to
     * hide a slice's load from memory otherwise. */
    const int64_t pf_panel = panel_stride * (wbf16 ? 2 : 4);
#if defined(__AVX512F__)
    __m512 z[4][8];
    for (int r = 0; r < ROWS; r++)
        for (int q = 0; q < P; q++) z[r][q] = _mm512_setzero_ps();
    if (wbf16) {
        const uint16_t* restrict b = (const uint16_t*)wp;
        for (int k = 0; k < kc; k++, b += NR) {
            if (pf != NULL && !(k & 1))
                for (int q = 0; q < P; q++) prefetch_line(pf + q * pf_panel, k / 2);
            for (int q = 0; q < P; q++) {
                const __m512 bq = load_bf16x16(b + q * panel_stride);
                for (int r = 0; r < ROWS; r++)
                    z[r][q] = _mm512_fmadd_ps(_mm512_set1_ps(a[(int64_t)r * lda + k]), bq,
                                              z[r][q]);
            }
        }
    } else {
        const float* restrict b = (const float*)wp;
        for (int k = 0; k < kc; k++, b += NR) {
            if (pf != NULL)
                for (int q = 0; q < P; q++) prefetch_line(pf + q * pf_panel, k);
            for (int q = 0; q < P; q++) {
                const __m512 bq = _mm512_load_ps(b + q * panel_stride);
                for (int r = 0; r < ROWS; r++)
                    z[r][q] = _mm512_fmadd_ps(_mm512_set1_ps(a[(int64_t)r * lda + k]), bq,
                                              z[r][q]);
            }
        }
    }
    __m256 c[4][8][2];
    for (int r = 0; r < ROWS; r++)
        for (int q = 0; q < P; q++) split_zmm(z[r][q], c[r][q]);
#else
    __m256 c[4][4][2];
    for (int r = 0; r < ROWS; r++)
        for (int q = 0; q < P; q++) c[r][q][0] = c[r][q][1] = _mm256_setzero_ps();
    if (wbf16) {
        const uint16_t* restrict b = (const uint16_t*)wp;
        for (int k = 0; k < kc; k++, b += NR) {
            if (pf != NULL && !(k & 1))
                for (int q = 0; q < P; q++) prefetch_line(pf + q * pf_panel, k / 2);
            for (int q = 0; q < P; q++) {
                const __m256 b0 = load_bf16x8(b + q * panel_stride);
                const __m256 b1 = load_bf16x8(b + q * panel_stride + 8);
                for (int r = 0; r < ROWS; r++) {
                    const __m256 x = _mm256_broadcast_ss(a + (int64_t)r * lda + k);
                    c[r][q][0] = _mm256_fmadd_ps(x, b0, c[r][q][0]);
                    c[r][q][1] = _mm256_fmadd_ps(x, b1, c[r][q][1]);
                }
            }
        }
    } else {
        const float* restrict b = (const float*)wp;
        for (int k = 0; k < kc; k++, b += NR) {
            if (pf != NULL)
                for (int q = 0; q < P; q++) prefetch_line(pf + q * pf_panel, k);
            for (int q = 0; q < P; q++) {
                const __m256 b0 = _mm256_load_ps(b + q * panel_stride);
                const __m256 b1 = _mm256_load_ps(b + q * panel_stride + 8);
                for (int r = 0; r < ROWS; r++) {
                    const __m256 x = _mm256_broadcast_ss(a + (int64_t)r * lda + k);
                    c[r][q][0] = _mm256_fmadd_ps(x, b0, c[r][q][0]);
                    c[r][q][1] = _mm256_fmadd_ps(x, b1, c[r][q][1]);
                }
            }
        }
    }
#endif
    for (int q = 0; q < P; q++) {
        __m256 acc[MR][2];
        for (int r = 0; r < MR; r++) {
            acc[r][0] = r < ROWS ? c[r][q][0] : _mm256_setzero_ps();
            acc[r][1] = r < ROWS ? c[r][q][1] : _mm256_setzero_ps();
        }
        tile_store(acc, part + q * part_step, ldp, accumulate, last, mr, nrs[q],
                   bias == NULL ? NULL : bias + q * NR, gate_up, out + q * cols, ldo);
    }
}

/* tile_few for mr = 1..4 rows over np panels: 4 at a time at one row, 2 at two or three
 * (2 x 2 x ROWS accumulators), 1 at four. */
static void tiles_few(int np, int kc, const float* a, int lda, const void* wp,
                      int64_t panel_stride,
                      int wbf16, float* part, int ldp, int part_step, int accumulate,
                      int last, int mr, const int* nrs, const float* bias, int gate_up,
                      float* out, int ldo, int cols, int prefetch, const char* pf_after) {
    const size_t wsize = wbf16 ? sizeof(uint16_t) : sizeof(float);
    while (np > 0) {
        /* prefetch: each call prefetches the slice of the panels after its own, and the
         * last one pf_after (the caller's next slice, or NULL) */
        const char* pf;
#define FEW(R, P) (pf = !prefetch ? NULL                                                    \
                   : np > (P) ? (const char*)wp + (P) * panel_stride * wsize : pf_after,   \
                   tile_few(R, P, kc, a, lda, wp, panel_stride, wbf16, part, ldp, part_step, \
                            accumulate, last, mr, nrs, bias, gate_up, out, ldo, cols, pf))
#if defined(__AVX512F__)
        /* one zmm a row and panel: up to 8 accumulators (8 FMA chains) */
        const int step = mr == 1 ? (np >= 8 ? 8 : np >= 4 ? 4 : np >= 2 ? 2 : 1)
                         : (np >= 4 ? 4 : np >= 2 ? 2 : 1);
        if (mr == 1) {
            if (step == 8) FEW(1, 8); else if (step == 4) FEW(1, 4);
            else if (step == 2) FEW(1, 2); else FEW(1, 1);
        } else if (mr == 2) {
            if (step == 4) FEW(2, 4); else if (step == 2) FEW(2, 2); else FEW(2, 1);
        } else if (mr == 3) {
            if (step == 4) FEW(3, 4); else if (step == 2) FEW(3, 2); else FEW(3, 1);
        } else {
            if (step == 4) FEW(4, 4); else if (step == 2) FEW(4, 2); else FEW(4, 1);
        }
#else
        const int step = mr == 1 ? (np >= 4 ? 4 : np >= 2 ? 2 : 1)
                         : mr < 4 && np >= 2 ? 2 : 1;
        if (mr == 1) {
            if (step == 4) FEW(1, 4); else if (step == 2) FEW(1, 2); else FEW(1, 1);
        } else if (mr == 2) {
            if (step == 2) FEW(2, 2); else FEW(2, 1);
        } else if (mr == 3) {
            if (step == 2) FEW(3, 2); else FEW(3, 1);
        } else {
            FEW(4, 1);
        }
#endif
#undef FEW
        np -= step;
        wp = (const char*)wp + step * panel_stride * wsize;
        part += step * part_step;
        nrs += step;
        if (bias != NULL) bias += step * NR;
        out += step * cols;
    }
}

/* The calling thread's float32 copy of one bf16 panel slice (KC_MAX x 16: 18 KB, stays in
 * L1), for tiles that would otherwise widen the same weights once per 6-row sliver. */
static __thread float* wide_buf = NULL;

static const float* widen_panel(const uint16_t* b, int kc, const char* pf) {
    if (wide_buf == NULL) {
        wide_buf = (float*)aligned_alloc(64, sizeof(float) * KC_MAX * NR);
        if (wide_buf == NULL) return NULL;
    }
    for (int i = 0; i < kc * NR; i += 8) {
        if (pf != NULL && i % 32 == 0) prefetch_line(pf, i / 32); /* 32 bf16 a line */
        _mm256_store_ps(wide_buf + i, load_bf16x8(b + i));
    }
    return wide_buf;
}

/*
 * x: [M, K] rows lda apart; wp packed (see above) for N output columns, or for N = 2I
 * gate/up rows when gate_up (then out is [M, I]); bias: NULL or N floats (plain only);
 * out: rows ldo apart; serial: run every tile on the calling thread (a group of
 * gemm_f32_grouped). Returns 0, or -1 if memory ran out.
 */
static int gemm_run(const float* x, int lda, const void* wp, int wbf16, const float* bias,
                    float* out, int ldo, int M, int N, int K, int gate_up, int serial) {
    const size_t wsize = wbf16 ? sizeof(uint16_t) : sizeof(float);
    const int nout = gate_up ? N / 2 : N;
    const int cols = gate_up ? 8 : NR; /* output columns per panel */
    const int np = (nout + cols - 1) / cols;
    const int nkb = (K + KC_MAX - 1) / KC_MAX, kcb = (K + nkb - 1) / nkb;
    const int ns = (M + MR - 1) / MR, mcs = MC / MR;
    const int nmb = (ns + mcs - 1) / mcs;
    /* Enough tiles that two threads stay busy at decode sizes (one M block). */
    int ncp = np * nmb / 16;
    ncp = ncp < 1 ? 1 : ncp > 16 ? 16 : ncp;
    /* Up to 4 rows (decode at small batches): tiles_few takes a task's panels up to 4 at
     * a time, so give tasks at least 4. */
    const int few = M <= 4;
    if (few && ncp < 4) ncp = np < 4 ? np : 4;
    const int nnb = (np + ncp - 1) / ncp;
    int failed = 0;
    #pragma omp parallel if (!serial)
    {
        /* Gate/up partial sums over K blocks need a home: out holds only I columns. */
        float* part = NULL;
        if (gate_up && nkb > 1) {
            part = (float*)aligned_alloc(64, sizeof(float) * (size_t)MC * ncp * NR);
            if (part == NULL) {
                #pragma omp atomic write
                failed = 1;
            }
        }
        #pragma omp for schedule(dynamic, 1) collapse(2)
        for (int mb = 0; mb < nmb; mb++)
            for (int nb = 0; nb < nnb; nb++) {
                int stop;
                #pragma omp atomic read
                stop = failed;
                if (stop) continue;
                const int s0 = mb * mcs, s1 = s0 + mcs < ns ? s0 + mcs : ns;
                const int p0 = nb * ncp, p1 = p0 + ncp < np ? p0 + ncp : np;
                for (int kb = 0; kb < nkb; kb++) {
                    const int k0 = kb * kcb, kc = K - k0 < kcb ? K - k0 : kcb;
                    const float* xb = x + k0; /* this K block's columns of x */
                    /* A last sliver of 1-4 rows (all of M when few; M = 8: 6 + 2) runs in
                     * few-row tiles over the task's panels after the full ones, not as a
                     * 6-row tile. */
                    const int tail = s1 == ns && M - (ns - 1) * MR <= 4;
                    const int s1f = s1 - tail;
                    for (int p = p0; p < p1 && s1f > s0; p++) {
                        const void* bp = (const char*)wp + ((int64_t)p * K + k0) * NR * wsize;
                        /* The next weight slice this task reads (the next panel's, or the
                         * first panel's of the next K block) is prefetched while this one
                         * is computed on, its lines spread over the slivers' tiles: at
                         * decode row counts the weights come from memory, and without it
                         * a slice's load and its FMAs took turns (1.1-1.3x at 8-32 rows). */
                        const int npt = p1 - p0, next = kb * npt + (p - p0) + 1;
                        const char* pf = next >= nkb * npt ? NULL
                            : (const char*)wp + ((int64_t)(p0 + next % npt) * K
                                                 + (int64_t)(next / npt) * kcb) * NR * wsize;
                        int lines = pf == NULL ? 0 : (int)((kc * NR * wsize + 63) / 64);
                        int tile_bf16 = wbf16;
                        if (wbf16 && s1f - s0 > 1) {
                            /* several slivers read this slice: widen it once, not per
                             * sliver (what made bf16 weights slower from 32 rows up) */
                            const float* wide = widen_panel((const uint16_t*)bp, kc, pf);
                            if (wide != NULL) {
                                bp = wide;
                                tile_bf16 = 0;
                                lines = 0;
                            }
                        }
                        const int chunk = s1f > s0 ? (lines + (s1f - s0) - 1) / (s1f - s0) : 0;
                        const int nr = nout - p * cols < cols ? nout - p * cols : cols;
                        const float* bias_p = bias == NULL ? NULL : bias + p * NR;
                        for (int s = s0; s < s1f; s++) {
                            const int mr = M - s * MR < MR ? M - s * MR : MR;
                            float* o = out + (int64_t)s * MR * ldo + (int64_t)p * cols;
                            float* pp = o;
                            int ldp = ldo;
                            if (part != NULL) {
                                pp = part + (int64_t)(s - s0) * MR * ncp * NR
                                     + (int64_t)(p - p0) * NR;
                                ldp = ncp * NR;
                            }
                            tile_6x16(kc, xb + (int64_t)s * MR * lda, lda, bp, tile_bf16, pp,
                                      ldp, kb > 0, kb == nkb - 1, mr, nr, bias_p, gate_up, o,
                                      ldo,
                                      pf == NULL ? NULL : pf + (int64_t)(s - s0) * chunk * 64,
                                      lines - (s - s0) * chunk < chunk
                                          ? lines - (s - s0) * chunk : chunk);
                        }
                    }
                    if (tail) {
                        const int s = ns - 1;
                        /* A grouped GEMM's serial run (an expert's few rows, every
                         * task on this thread) prefetches one slice ahead in the few-row
                         * tiles too; after this task's panels, the next K block's first
                         * ones, or after the last K block the next task's. */
                        const char* next_slice =
                            kb + 1 < nkb
                                ? (const char*)wp + ((int64_t)p0 * K + k0 + kcb) * NR * wsize
                            : p1 < np && nb + 1 < nnb
                                ? (const char*)wp + (int64_t)p1 * K * NR * wsize : NULL;
                        int nrs[16];
                        for (int p = p0; p < p1; p++)
                            nrs[p - p0] = nout - p * cols < cols ? nout - p * cols : cols;
                        float* o = out + (int64_t)s * MR * ldo + (int64_t)p0 * cols;
                        tiles_few(p1 - p0, kc, xb + (int64_t)s * MR * lda, lda,
                                  (const char*)wp + ((int64_t)p0 * K + k0) * NR * wsize,
                                  (int64_t)K * NR, wbf16,
                                  part != NULL ? part + (int64_t)(s - s0) * MR * ncp * NR : o,
                                  part != NULL ? ncp * NR : ldo, part != NULL ? NR : cols,
                                  kb > 0, kb == nkb - 1, M - s * MR, nrs,
                                  bias == NULL ? NULL : bias + p0 * NR, gate_up, o, ldo, cols,
                                  serial, next_slice);
                    }
                }
            }
        free(part);
    }
    return failed ? -1 : 0;
}

int gemm_f32(const float* x, int lda, const float* wp, const float* bias, float* out,
             int ldo, int M, int N, int K, int gate_up) {
    return gemm_run(x, lda, wp, 0, bias, out, ldo, M, N, K, gate_up, 0);
}

/* As gemm_f32, with wp packed by gemm_pack_weight_bf16. */
int gemm_f32_w16(const float* x, int lda, const uint16_t* wp, const float* bias, float* out,
                 int ldo, int M, int N, int K, int gate_up) {
    return gemm_run(x, lda, wp, 1, bias, out, ldo, M, N, K, gate_up, 0);
}

/*
 * n GEMMs of one shape in one parallel region (a mixture of experts' projections at
 * decode sizes, where a region per expert's few rows costs more than its FMAs): group g
 * is rows starts[g] .. starts[g + 1] - 1 of x times the weight packed at wps[g] (as
 * gemm_f32 or, wbf16, gemm_f32_w16 packs it), into the same rows of out. No bias.
 * Tasks are a group's panels in runs (a run of panels is a GEMM of its own: panel-major
 * packing, each output column the same sum in the same order, so the same bits as
 * gemm_f32 gives the group alone), at least 8 tasks a thread over the active groups and
 * at least 4 panels a task (the few-row tiles take 4 at a time), handed out dynamically:
 * a thread per whole group left one thread idle wherever the active groups did not
 * divide among the threads or their rows differed.
 */
int gemm_f32_grouped(int n, const float* x, int lda, const void* const* wps, int wbf16,
                     float* out, int ldo, const int* starts, int N, int K, int gate_up) {
    const size_t wsize = wbf16 ? sizeof(uint16_t) : sizeof(float);
    const int nout = gate_up ? N / 2 : N;
    const int cols = gate_up ? 8 : NR; /* output columns per panel */
    const int np = (nout + cols - 1) / cols;
    int active = 0;
    for (int g = 0; g < n; g++) active += starts[g + 1] > starts[g];
    if (active == 0 || np == 0) return 0;
    const int pieces = (8 * omp_get_max_threads() + active - 1) / active;
    int chunk = (np + pieces - 1) / pieces;
    if (chunk < 4) chunk = 4;
    const int per = (np + chunk - 1) / chunk; /* tasks a group */
    int failed = 0;
    #pragma omp parallel for schedule(dynamic, 1)
    for (int t = 0; t < n * per; t++) {
        const int g = t / per, p0 = (t % per) * chunk;
        const int m = starts[g + 1] - starts[g];
        if (m <= 0) continue;
        const int o0 = p0 * cols, o1 = (p0 + chunk) * cols < nout ? (p0 + chunk) * cols : nout;
        const char* w = (const char*)wps[g] + (int64_t)p0 * K * NR * wsize;
        if (gemm_run(x + (int64_t)starts[g] * lda, lda, w, wbf16, NULL,
                     out + (int64_t)starts[g] * ldo + o0, ldo, m,
                     gate_up ? 2 * (o1 - o0) : o1 - o0, K, gate_up, 1)) {
            #pragma omp atomic write
            failed = 1;
        }
    }
    return failed ? -1 : 0;
}

#else
/* No AVX2/FMA: callers keep oneDNN or torch. */
int gemm_f32_available(void) { return 0; }
int gemm_f32(const float* x, int lda, const float* wp, const float* bias, float* out,
             int ldo, int M, int N, int K, int gate_up) {
    return -1;
}
int gemm_f32_w16(const float* x, int lda, const uint16_t* wp, const float* bias, float* out,
                 int ldo, int M, int N, int K, int gate_up) {
    return -1;
}
int gemm_f32_grouped(int n, const float* x, int lda, const void* const* wps, int wbf16,
                     float* out, int ldo, const int* starts, int N, int K, int gate_up) {
    return -1;
}
#endif
