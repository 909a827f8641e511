/*
 * Causal self-attention of a fresh prompt in bfloat16 on AMX tiles (Intel Sapphire
 * Rapids and later: AMX-BF16), the bf16 path of prefill_attention.c where the build has
 * AMX; the same contract (GQA, row strides, query row t attends to keys 0..t), head dims
 * that are multiples of 32 up to 256.
 *
 * The AVX-512 BF16 body spends most of its time in the two matrix products; here each is
 * a handful of tile dot products (TDPBF16PS: 16 x 16 fp32 outputs over 32 bf16 terms,
 * products exact in fp32, sums in fp32), and what is left is the online softmax on
 * AVX-512. Per task, 16 query rows of one head walk the keys in blocks of 32:
 *
 *   S = Q K^T   Q's 16 rows x 32 dims as the A tile (D / 32 of them), K repacked per KV
 *               head into B tiles (pairs of dims of 16 keys: VNNI layout), two C tiles
 *               for the block's 32 keys
 *   softmax     S stored to memory, scaled, masked past the row, weighted against each
 *               row's reference max (softmax_block) and summed into its denominator;
 *               the numerators rounded to bf16 (as torch's CPU flash attention does in
 *               bf16, and the AVX-512 BF16 body; the denominator sums them unrounded, as
 *               there)
 *   O += P V    P's 16 rows x 32 keys as the A tile, V repacked into B tiles (pairs of
 *               keys of 16 dims), up to four C tiles at a time: up to 64 dims the output
 *               stays in C tiles for the whole walk, rescaled through memory only when a
 *               reference max moves; past 64 it lives in an fp32 accumulator
 *
 * K and V are repacked once per call (per KV head, blocks of 32 keys, zeros past L) and
 * shared by every task. Tiles are per-thread state: each thread configures its own and
 * releases them. Linux hands out AMX tile state only on request (arch_prctl
 * ARCH_REQ_XCOMP_PERM, once per process); where it refuses, or the build has no AMX,
 * prefill_attention_bf16_amx returns -1 and the caller runs the AVX-512 body. Built with
 * CONVEYOR_EMULATE_AMX on a CPU with AVX-512 BF16 and no AMX, the tile instructions are
 * amx_emulation.h's scalar C: the tests run this body there too.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if ((defined(__AMX_TILE__) && defined(__AMX_BF16__)) || defined(CONVEYOR_EMULATE_AMX)) && \
    defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "simd_math.h"
#include "transpose16.h"
#if !defined(__AMX_TILE__) /* CONVEYOR_EMULATE_AMX: the tiles in scalar C (tests) */
#include "amx_emulation.h"
#endif

#define NEG (-1e30f)
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int amx_tiles_available(void) {
#if defined(__AMX_TILE__)
    static volatile int state = 0; /* 0: not asked yet, 1: granted, -1: refused */
    if (state == 0) /* idempotent, so a race only asks twice */
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
#else
    return 1; /* emulated: no tile state to ask the OS for */
#endif
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) tile_config;

/* Eight tiles of 16 rows x 64 bytes: tmm0 A (Q or P), tmm1 B (K or V), tmm2-5 the output,
 * tmm6-7 the scores. */
static void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* A row of zeros for keys past L (D <= 256). */
static const uint16_t zero_row[256] __attribute__((aligned(64)));

/* KV head h's keys j0 .. j0 + 31 (zeros past L) into B tiles, each 16 rows of 16 pairs:
 *   kb (S):  [2 key halves][D / 32 dim slices][16 dim pairs r][16 keys n] = K[n][2r, 2r + 1]
 *   vb (PV): [D / 16 dim slices][16 key pairs r][16 dims n]             = V[2r, 2r + 1][n]
 * K's slices are 16 x 16 transposes of bf16 pairs (keys_to_columns, in registers: as
 * scalar stores GCC built them from scatters); V's rows are two keys' dims interleaved,
 * 16 at a time. */
static void pack_block(const uint16_t* k, const uint16_t* v, uint32_t* kb, uint32_t* vb, int j0,
                       int L, int h, int D, int kv_stride) {
    const void* rows[16];
    for (int half = 0; half < 2; half++) {
        for (int n = 0; n < 16; n++) {
            const int j = j0 + 16 * half + n;
            rows[n] = j < L ? (const void*)(k + (int64_t)j * kv_stride + (int64_t)h * D)
                            : (const void*)zero_row;
        }
        for (int s = 0; s < D / 32; s++)
            keys_to_columns(rows, 16 * s, kb + (int64_t)(half * (D / 32) + s) * 256);
    }
    for (int r = 0; r < 16; r++) {
        const int j = j0 + 2 * r;
        const uint16_t* v0 = j < L ? v + (int64_t)j * kv_stride + (int64_t)h * D : zero_row;
        const uint16_t* v1 = j + 1 < L ? v0 + kv_stride : zero_row;
        for (int s = 0; s < D / 16; s++) {
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v0 + 16 * s)));
            const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(v1 + 16 * s)));
            _mm512_store_si512(vb + (int64_t)(s * 16 + r) * 16,
                               _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* One task's state and buffers, per thread. */
typedef struct {
    uint16_t* qbuf;   /* [16][D] the task's query rows, zeros past L */
    float* acc;       /* [16][D] the output accumulators */
    float s[16][32] __attribute__((aligned(64)));
    uint16_t p[16][32] __attribute__((aligned(64)));
    __m512 lv[16];    /* each row's denominator by lanes, summed when the task ends */
    float m[16];      /* each row's reference max (scaled scores) */
} task_buffers;

/* S (tmm6, tmm7: keys j0 .. j0 + 15, j0 + 16 .. j0 + 31) = Q K^T, stored to b->s. */
static inline void scores(task_buffers* b, const uint32_t* kb, int D) {
    _tile_zero(6);
    _tile_zero(7);
    for (int ds = 0; ds < D / 32; ds++) {
        _tile_loadd(0, b->qbuf + ds * 32, D * 2);
        _tile_loadd(1, kb + (int64_t)ds * 256, 64);
        _tile_dpbf16ps(6, 0, 1);
        _tile_loadd(1, kb + (int64_t)(D / 32 + ds) * 256, 64);
        _tile_dpbf16ps(7, 0, 1);
    }
    _tile_stored(6, b->s[0], 128);
    _tile_stored(7, b->s[0] + 16, 128);
}

/* The softmax of one block of 32 keys for the task's 16 rows (rows past L are zeros of
 * Q: finite scores, never written out), into the bf16 numerators b->p. Each row keeps a
 * reference max m and weights e^(score - m): m moves only when a block's max exceeds it
 * by more than SLACK (then the row's accumulators and denominator are rescaled, through
 * memory, by rescale()), so the weights stay within e^SLACK and the output tiles can
 * accumulate across blocks without a rescale per block. Rounding the numerators to bf16
 * is relative, so the reference max changes no error bound. Returns whether a row's
 * reference max moved (its alpha in alpha[], 1 for the others). */
#define SLACK 8.f
static inline int softmax_block(task_buffers* b, int r0, int j0, float scale, float* alpha) {
    const __m512 scale_v = _mm512_set1_ps(scale), neg = _mm512_set1_ps(NEG);
    const __m512 slack = _mm512_set1_ps(SLACK);
    const int diagonal = j0 + 31 > r0; /* some keys of the block lie past some row */
    int moved = 0;
    for (int i = 0; i < 16; i++) {
        __m512 s0 = _mm512_load_ps(b->s[i]), s1 = _mm512_load_ps(b->s[i] + 16);
        if (diagonal) {
            const int valid = r0 + i - j0 + 1 < 32 ? r0 + i - j0 + 1 : 32; /* >= 1 */
            const uint32_t bits = valid == 32 ? 0xFFFFFFFFu : (1u << valid) - 1u;
            s0 = _mm512_mask_blend_ps((__mmask16)bits, neg, s0);
            s1 = _mm512_mask_blend_ps((__mmask16)(bits >> 16), neg, s1);
        }
        __m512 mv = _mm512_set1_ps(b->m[i]);
        __m512 x0 = _mm512_fmsub_ps(s0, scale_v, mv), x1 = _mm512_fmsub_ps(s1, scale_v, mv);
        alpha[i] = 1.f;
        /* The row's max only where a score passed the reference by more than SLACK (on
         * the first block, from NEG, always): a compare, where the max is a reduction. */
        if ((_mm512_cmp_ps_mask(x0, slack, _CMP_GT_OQ) |
             _mm512_cmp_ps_mask(x1, slack, _CMP_GT_OQ)) != 0) {
            const float mx = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)) * scale;
            alpha[i] = expf(b->m[i] - mx); /* 0 on the first block: nothing to rescale */
            b->lv[i] = _mm512_mul_ps(b->lv[i], _mm512_set1_ps(alpha[i]));
            b->m[i] = mx;
            moved = 1;
            mv = _mm512_set1_ps(mx);
            x0 = _mm512_fmsub_ps(s0, scale_v, mv);
            x1 = _mm512_fmsub_ps(s1, scale_v, mv);
        }
        const __m512 e0 = exp512(x0), e1 = exp512(x1);
        b->lv[i] = _mm512_add_ps(b->lv[i], _mm512_add_ps(e0, e1));
        _mm512_store_si512((__m512i*)b->p[i], (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    return moved;
}

/* C tiles 2 .. 2 + n - 1 += P (tmm0) x V slices s0 .. s0 + n - 1. */
static inline void pv_slices(const uint32_t* vb, int s0, int n) {
#define SLICE_(t, c)                                                                  \
    if (n > c) {                                                                      \
        _tile_loadd(1, vb + (int64_t)(s0 + c) * 256, 64);                             \
        _tile_dpbf16ps(t, 0, 1);                                                      \
    }
    SLICE_(2, 0) SLICE_(3, 1) SLICE_(4, 2) SLICE_(5, 3)
#undef SLICE_
}

/* The output tiles 2 .. 2 + n - 1 (dims 16 s0 ..) to and from b->acc. */
static inline void store_out(task_buffers* b, int D, int s0, int n) {
    float* a = b->acc + s0 * 16;
    if (n > 0) _tile_stored(2, a, D * 4);
    if (n > 1) _tile_stored(3, a + 16, D * 4);
    if (n > 2) _tile_stored(4, a + 32, D * 4);
    if (n > 3) _tile_stored(5, a + 48, D * 4);
}
static inline void load_out(task_buffers* b, int D, int s0, int n) {
    const float* a = b->acc + s0 * 16;
    if (n > 0) _tile_loadd(2, a, D * 4);
    if (n > 1) _tile_loadd(3, a + 16, D * 4);
    if (n > 2) _tile_loadd(4, a + 32, D * 4);
    if (n > 3) _tile_loadd(5, a + 48, D * 4);
}
static inline void zero_out(int n) {
    if (n > 0) _tile_zero(2);
    if (n > 1) _tile_zero(3);
    if (n > 2) _tile_zero(4);
    if (n > 3) _tile_zero(5);
}
/* acc rows *= alpha, dims 16 s0 .. 16 (s0 + n) */
static inline void rescale(task_buffers* b, const float* alpha, int D, int s0, int n) {
    for (int i = 0; i < 16; i++) {
        if (alpha[i] == 1.f) continue;
        const __m512 al = _mm512_set1_ps(alpha[i]);
        float* ai = b->acc + i * D + s0 * 16;
        for (int c = 0; c < n; c++) _mm512_store_ps(ai + 16 * c, _mm512_mul_ps(_mm512_load_ps(ai + 16 * c), al));
    }
}

/* One task: rows r0 .. r0 + nr - 1 of query head hq over KV head h's packed blocks. Up
 * to 64 dims the output stays in tiles 2-5 for the whole walk (stored and reloaded only
 * when a reference max moves); past 64 it is kept in b->acc, four slices at a time. */
static void run_task(task_buffers* b, const uint16_t* q, uint16_t* out, const uint32_t* kp,
                     const uint32_t* vp, size_t block, int nkb, int r0, int nr, int hq, int h,
                     int D, int q_stride, int out_stride, float scale) {
    for (int i = 0; i < 16; i++) {
        if (i < nr)
            memcpy(b->qbuf + i * D, q + (int64_t)(r0 + i) * q_stride + (int64_t)hq * D,
                   sizeof(uint16_t) * D);
        else
            memset(b->qbuf + i * D, 0, sizeof(uint16_t) * D);
        b->m[i] = NEG;
        b->lv[i] = _mm512_setzero_ps();
    }
    const int slices = D / 16, resident = slices <= 4;
    float alpha[16];
    if (resident) /* acc is only written from the tiles before it is read */
        zero_out(slices);
    else
        memset(b->acc, 0, sizeof(float) * 16 * D);
    /* j0 <= r0 for every block visited (both multiples of 16), so each row has key j0 at
     * least: its max is a real score and masked lanes' weights are exactly 0. */
    for (int j0 = 0; j0 < r0 + nr; j0 += 32) {
        const uint32_t* kb = kp + (h * nkb + j0 / 32) * block;
        const uint32_t* vb = vp + (h * nkb + j0 / 32) * block;
        scores(b, kb, D);
        const int moved = softmax_block(b, r0, j0, scale, alpha);
        if (resident) {
            if (moved && j0 > 0) {
                store_out(b, D, 0, slices);
                rescale(b, alpha, D, 0, slices);
                load_out(b, D, 0, slices);
            }
            _tile_loadd(0, b->p[0], 64);
            pv_slices(vb, 0, slices);
        } else {
            for (int s0 = 0; s0 < slices; s0 += 4) {
                const int n = slices - s0 < 4 ? slices - s0 : 4;
                if (moved) rescale(b, alpha, D, s0, n);
                load_out(b, D, s0, n);
                _tile_loadd(0, b->p[0], 64);
                pv_slices(vb, s0, n);
                store_out(b, D, s0, n);
            }
        }
    }
    if (resident) store_out(b, D, 0, slices);
    for (int i = 0; i < nr; i++) {
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(b->lv[i]));
        uint16_t* o = out + (int64_t)(r0 + i) * out_stride + (int64_t)hq * D;
        for (int d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i*)(o + d), (__m256i)_mm512_cvtneps_pbh(
                _mm512_mul_ps(_mm512_load_ps(b->acc + i * D + d), inv)));
    }
}

int prefill_attention_bf16_amx(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                               uint16_t* out, int L, int Hq, int Hkv, int D, int q_stride,
                               int kv_stride, int out_stride, float scale) {
    if (D % 32 != 0 || D > 256 || L <= 0 || Hq % Hkv != 0 || !(scale > 0.f) ||
        !amx_tiles_available())
        return -1;
    const int G = Hq / Hkv, nkb = (L + 31) / 32, nqb = (L + 15) / 16;
    const size_t block = (size_t)32 * D / 2; /* uint32 pairs per packed block of 32 keys */
    uint32_t* kp = (uint32_t*)aligned_alloc(64, sizeof(uint32_t) * block * Hkv * nkb);
    uint32_t* vp = (uint32_t*)aligned_alloc(64, sizeof(uint32_t) * block * Hkv * nkb);
    if (kp == NULL || vp == NULL) {
        free(kp);
        free(vp);
        return -1;
    }
    #pragma omp parallel if (!omp_in_parallel()) /* (inactive inside a varlen call) */
    {
    #pragma omp for schedule(static)
    for (int c = 0; c < Hkv * nkb; c++)
        pack_block(k, v, kp + c * block, vp + c * block, (c % nkb) * 32, L, c / nkb, D, kv_stride);
    configure_tiles();
    task_buffers* b = (task_buffers*)aligned_alloc(64, sizeof(task_buffers));
    b->qbuf = (uint16_t*)aligned_alloc(64, sizeof(uint16_t) * 16 * D);
    b->acc = (float*)aligned_alloc(64, sizeof(float) * 16 * D);
    /* Largest blocks first (their work grows with the row index). */
    #pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < Hq * nqb; task++) {
        const int blk = nqb - 1 - task / Hq, hq = task % Hq;
        const int r0 = blk * 16, nr = L - r0 < 16 ? L - r0 : 16;
        run_task(b, q, out, kp, vp, block, nkb, r0, nr, hq, hq / G, D, q_stride, out_stride,
                 scale);
    }
    _tile_release();
    free(b->qbuf);
    free(b->acc);
    free(b);
    }
    free(kp);
    free(vp);
    return 0;
}

#else
int amx_tiles_available(void) { return 0; }

int prefill_attention_bf16_amx(const uint16_t* q, const uint16_t* k, const uint16_t* v,
                               uint16_t* out, int L, int Hq, int Hkv, int D, int q_stride,
                               int kv_stride, int out_stride, float scale) {
    (void)q; (void)k; (void)v; (void)out; (void)L; (void)Hq; (void)Hkv; (void)D;
    (void)q_stride; (void)kv_stride; (void)out_stride; (void)scale;
    return -1;
}
#endif
