/*
 * The AVX-512F body of prefill_attention.c's kernel, included once per element type and
 * head dim (TIN, LOAD, START_TASK, FINISH_TASK, D (a multiple of 16) and NAME defined).
 * The AVX2 body's task split, tiles and online softmax with 16-lane registers:
 *
 *   scores  4 queries x KC (16) keys, one zmm per query; even and odd dims accumulate
 *           apart (8 independent FMA chains, enough to cover the FMA latency), so a step
 *           over two dims is two tile loads, eight broadcast FMAs
 *   softmax a query's 16 scores in one register: masked by a lane mask, its max and sum
 *           by reductions, its exponentials by exp512
 *   P @ V   4 queries x up to 64 dims of the output in up to 16 zmm accumulators,
 *           rescaled once per chunk; a key is up to four loads of its V row, four
 *           broadcasts of the probabilities and up to sixteen FMAs
 *
 * Where the AVX2 body needs 8 FMAs per dim for 4 queries x 16 keys, this one needs 4; with
 * bf16 inputs on a CPU with AVX-512 BF16 the scores take 2 (vdpbf16ps on bf16 pairs of
 * dims: the products of two bf16 values are exact in float32, so only the order of the
 * float32 sums differs from the FMAs'), and P @ V takes half the instructions: the
 * softmax numerators are rounded to bf16 (as torch's CPU flash attention does in bf16;
 * the denominator sums them unrounded, as there) and V is tiled as bf16 pairs of keys,
 * two keys per vdpbf16ps. On a 256-token prompt (9/3 heads x 64) that is 1.13x the
 * float32 P @ V (benchmarks/kernels/prefill_attention.py), and closer to torch's bf16 output.
 */
#define NV_ (D >= 64 ? 4 : D / 16) /* zmm registers of output per query in a pass */
/* bf16 inputs on a CPU with AVX-512 BF16: the scores by bf16 dot products. */
#if defined(__AVX512BF16__) && defined(TIN_IS_BF16)
#define DOT_BF16_ 1
#else
#define DOT_BF16_ 0
#endif
#ifndef CONVEYOR_MAX4_
#define CONVEYOR_MAX4_
#include "transpose16.h" /* keys_to_columns (16 x 16: KC is 16) */
_Static_assert(KC == 16, "keys_to_columns transposes chunks of 16 keys");
/* The maxima of four registers, the maximum of s[a] in every lane of 128-bit lane a: two
 * folds across 128-bit lanes (shuffle_f32x4) take the four registers into one, two
 * in-lane permutes finish each lane (8 shuffles and 6 maxes for four queries, where four
 * _mm512_reduce_max_ps take 12 and 12 and a broadcast each). */
static inline __m512 max4(const __m512 s[4]) {
    const __m512 u = _mm512_max_ps(_mm512_shuffle_f32x4(s[0], s[1], 0x44),
                                   _mm512_shuffle_f32x4(s[0], s[1], 0xEE));
    const __m512 w = _mm512_max_ps(_mm512_shuffle_f32x4(s[2], s[3], 0x44),
                                   _mm512_shuffle_f32x4(s[2], s[3], 0xEE));
    __m512 x = _mm512_max_ps(_mm512_shuffle_f32x4(u, w, 0x88), _mm512_shuffle_f32x4(u, w, 0xDD));
    x = _mm512_max_ps(x, _mm512_permute_ps(x, 0x4E));
    return _mm512_max_ps(x, _mm512_permute_ps(x, 0xB1));
}
#endif
static void NAME(const TIN* restrict q, const TIN* restrict k, const TIN* restrict v,
                 TIN* restrict out, int L, int Hq, int Hkv, int q_stride, int kv_stride,
                 int out_stride, float scale, float softcap) {
    const int G = Hq / Hkv;
    const int nblocks = (L + QB - 1) / QB;
    const int ntasks = Hkv * nblocks;
    const int nchunks = (L + KC - 1) / KC;
    float* kts = (float*)aligned_alloc(64, sizeof(float) * (size_t)Hkv * nchunks * D * KC);
    float* vts = (float*)aligned_alloc(64, sizeof(float) * (size_t)Hkv * nchunks * KC * D);
#if DOT_BF16_
    /* K as bf16 pairs: [D / 2][KC] 32-bit lanes, dims 2p (low half) and 2p + 1 of a key. */
    uint32_t* kps = (uint32_t*)kts;
#endif
    #pragma omp parallel if (!omp_in_parallel()) /* (inactive inside a varlen call) */
    {
    #pragma omp for schedule(static)
    for (int c = 0; c < Hkv * nchunks; c++) {
        const int h = c / nchunks, j0 = (c % nchunks) * KC;
        const int kn = L - j0 < KC ? L - j0 : KC;
        float* vt = vts + (int64_t)c * KC * D;
        const void* krow[KC]; /* the chunk's key rows (past its end, its last one again) */
        for (int jj = 0; jj < KC; jj++)
            krow[jj] = k + (int64_t)(j0 + (jj < kn ? jj : kn - 1)) * kv_stride + (int64_t)h * D;
#if DOT_BF16_
        /* K as bf16 pairs of dims (2p, 2p + 1 of a key per lane), V as bf16 pairs of keys
         * ([KC / 2][D]: keys 2p and 2p + 1 of a dim per lane, zeros past the chunk's end)
         * instead of the float tiles. */
        uint32_t* kp = kps + (int64_t)c * D * KC;
        uint32_t* vp = (uint32_t*)vt;
        if (D % 32 == 0) { /* 16 pairs of dims a step */
            for (int g = 0; g < D / 32; g++) keys_to_columns(krow, 16 * g, kp + 16 * g * KC);
        } else {
            for (int jj = 0; jj < KC; jj++) {
                const TIN* kr = (const TIN*)krow[jj];
                for (int d = 0; d < D; d += 2)
                    kp[d / 2 * KC + jj] = (uint32_t)kr[d] | (uint32_t)kr[d + 1] << 16;
            }
        }
        for (int jp = 0; jp < KC / 2; jp++) {
            const TIN* v0 = v + (int64_t)(j0 + 2 * jp) * kv_stride + (int64_t)h * D;
            for (int d = 0; d < D; d++) {
                const uint32_t lo = 2 * jp < kn ? v0[d] : 0u;
                const uint32_t hi = 2 * jp + 1 < kn ? v0[kv_stride + d] : 0u;
                vp[(int64_t)jp * D + d] = lo | hi << 16;
            }
        }
#else
        float* kt = kts + (int64_t)c * D * KC;
        if (sizeof(TIN) == sizeof(float)) { /* float32 K: 16 dims a step */
            for (int g = 0; g < D / 16; g++)
                keys_to_columns(krow, 16 * g, (uint32_t*)kt + 16 * g * KC);
            kt = NULL; /* (V only, below) */
        }
        TILE_CHUNK(k, v, kt, vt, j0, kn, h, kv_stride, D);
#endif
    }
    const int nq_max = (QB * G + 3) / 4 * 4;
    float* m = (float*)malloc(sizeof(float) * (size_t)nq_max);
    float* l = (float*)malloc(sizeof(float) * (size_t)nq_max);
    float* acc = (float*)aligned_alloc(64, sizeof(float) * (size_t)nq_max * D);
    float* lv = (float*)aligned_alloc(64, sizeof(float) * (size_t)nq_max * 16);
    const __m512i lane_of_query = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i first_of_lane = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
#if DOT_BF16_
    float* qs = NULL; /* the queries go in as bf16 pairs (qp) */
#else
    float* qs = (float*)aligned_alloc(64, sizeof(float) * (size_t)nq_max * D);
#endif
#if DOT_BF16_
    uint32_t* qp = (uint32_t*)aligned_alloc(64, sizeof(uint32_t) * (size_t)nq_max * D / 2);
    const __m512 scale_v = _mm512_set1_ps(scale);
#endif
    const __m512 neg = _mm512_set1_ps(NEG), slack = _mm512_set1_ps(SLACK);
    /* Largest blocks first (their work grows with the row index). */
    #pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < ntasks; task++) {
        const int blk = nblocks - 1 - task / Hkv, h = task % Hkv;
        const int r0 = blk * QB, r1 = r0 + QB < L ? r0 + QB : L;
        const int nq = (r1 - r0) * G, nq4 = (nq + 3) / 4 * 4;
        START_TASK(q, qs, m, l, acc, nq, nq4, r0, G, h, q_stride, D, scale);
        memset(lv, 0, sizeof(float) * (size_t)nq4 * 16);
#if DOT_BF16_
        /* The queries' own bf16 pairs (unscaled: the scale multiplies the scores, so no
         * second rounding), zeros for padding. A pair of dims (2p, 2p + 1) as one 32-bit
         * lane, low half first, is the row's own bytes: a copy (written as the pairs'
         * shifts and ors, GCC built it from permutes and scatters: ~10% of the kernel's
         * time on a mix of prompts, under perf on a Zen 4). */
        for (int i = 0; i < nq4; i++) {
            uint32_t* dst = qp + (int64_t)i * D / 2;
            if (i < nq)
                memcpy(dst, q + (int64_t)(r0 + i / G) * q_stride + (int64_t)(h * G + i % G) * D,
                       sizeof(TIN) * D);
            else
                memset(dst, 0, sizeof(TIN) * D);
        }
#endif
        for (int j0 = 0; j0 < r1; j0 += KC) {
            const int kn = r1 - j0 < KC ? r1 - j0 : KC;
            const float* kt = kts + ((int64_t)h * nchunks + j0 / KC) * D * KC;
#if DOT_BF16_
            const uint32_t* kp = kps + ((int64_t)h * nchunks + j0 / KC) * D * KC;
#endif
            const float* vt = vts + ((int64_t)h * nchunks + j0 / KC) * KC * D;
            for (int i0 = 0; i0 < nq; i0 += 4) {
                const int last = r0 + (i0 + 3 < nq ? i0 + 3 : nq - 1) / G; /* tile's last row */
                if (last < j0) continue;
#if DOT_BF16_
                /* vdpbf16ps: two dims of 16 keys per instruction, the products exact in
                 * float32 (bf16 x bf16), summed in float32 as the FMAs below would. */
                const uint32_t* q0 = qp + (int64_t)i0 * D / 2;
                __m512 e0 = _mm512_setzero_ps(), o0 = e0, e1 = e0, o1 = e0, e2 = e0, o2 = e0,
                       e3 = e0, o3 = e0;
                for (int d = 0; d < D / 2; d += 2) {
                    const __m512bh k0 = (__m512bh)_mm512_load_si512(kp + d * KC);
                    const __m512bh k1 = (__m512bh)_mm512_load_si512(kp + (d + 1) * KC);
#define QB_(x) ((__m512bh)_mm512_set1_epi32((int)(x)))
                    e0 = _mm512_dpbf16_ps(e0, QB_(q0[d]), k0);
                    o0 = _mm512_dpbf16_ps(o0, QB_(q0[d + 1]), k1);
                    e1 = _mm512_dpbf16_ps(e1, QB_(q0[D / 2 + d]), k0);
                    o1 = _mm512_dpbf16_ps(o1, QB_(q0[D / 2 + d + 1]), k1);
                    e2 = _mm512_dpbf16_ps(e2, QB_(q0[D + d]), k0);
                    o2 = _mm512_dpbf16_ps(o2, QB_(q0[D + d + 1]), k1);
                    e3 = _mm512_dpbf16_ps(e3, QB_(q0[3 * D / 2 + d]), k0);
                    o3 = _mm512_dpbf16_ps(o3, QB_(q0[3 * D / 2 + d + 1]), k1);
#undef QB_
                }
                __m512 sc[4] = {_mm512_mul_ps(_mm512_add_ps(e0, o0), scale_v),
                                      _mm512_mul_ps(_mm512_add_ps(e1, o1), scale_v),
                                      _mm512_mul_ps(_mm512_add_ps(e2, o2), scale_v),
                                      _mm512_mul_ps(_mm512_add_ps(e3, o3), scale_v)};
#else
                const float* q0 = qs + (int64_t)i0 * D;
                __m512 e0 = _mm512_setzero_ps(), o0 = e0, e1 = e0, o1 = e0, e2 = e0, o2 = e0,
                       e3 = e0, o3 = e0;
                for (int d = 0; d < D; d += 2) {
                    const __m512 k0 = _mm512_load_ps(kt + d * KC);
                    const __m512 k1 = _mm512_load_ps(kt + (d + 1) * KC);
                    e0 = _mm512_fmadd_ps(_mm512_set1_ps(q0[d]), k0, e0);
                    o0 = _mm512_fmadd_ps(_mm512_set1_ps(q0[d + 1]), k1, o0);
                    e1 = _mm512_fmadd_ps(_mm512_set1_ps(q0[D + d]), k0, e1);
                    o1 = _mm512_fmadd_ps(_mm512_set1_ps(q0[D + d + 1]), k1, o1);
                    e2 = _mm512_fmadd_ps(_mm512_set1_ps(q0[2 * D + d]), k0, e2);
                    o2 = _mm512_fmadd_ps(_mm512_set1_ps(q0[2 * D + d + 1]), k1, o2);
                    e3 = _mm512_fmadd_ps(_mm512_set1_ps(q0[3 * D + d]), k0, e3);
                    o3 = _mm512_fmadd_ps(_mm512_set1_ps(q0[3 * D + d + 1]), k1, o3);
                }
                __m512 sc[4] = {_mm512_add_ps(e0, o0), _mm512_add_ps(e1, o1),
                                      _mm512_add_ps(e2, o2), _mm512_add_ps(e3, o3)};
#endif
                if (softcap > 0.f) { /* soft-capped logits (softcap.h), before the mask */
                    float cs[4][KC] __attribute__((aligned(64)));
                    for (int a = 0; a < 4; a++) _mm512_store_ps(cs[a], sc[a]);
                    softcap_scores(cs[0], 4 * KC, softcap);
                    for (int a = 0; a < 4; a++) sc[a] = _mm512_load_ps(cs[a]);
                }
#if DOT_BF16_
                uint32_t pp[4][KC / 2] __attribute__((aligned(32)));
#else
                float p[4][KC] __attribute__((aligned(64)));
#endif
                /* Keys past row t (and padding) are masked; padded queries mask all. */
                __m512 s4[4];
                for (int a = 0; a < 4; a++) {
                    const int i = i0 + a, t = r0 + i / G;
                    const int valid = i >= nq || t < j0 ? 0 : (t - j0 + 1 < kn ? t - j0 + 1 : kn);
                    s4[a] = _mm512_mask_blend_ps((__mmask16)((1u << valid) - 1u), neg, sc[a]);
                }
                /* Each query's reference max (query a in 128-bit lane a) moves only when
                 * a score passes it by more than SLACK (on its first chunk, from NEG, it
                 * always does): then the four queries' running maxima (max4's fold) and
                 * rescales alpha = e^(old max - new) as online softmax has them. Else the
                 * weights e^(score - reference) stay within e^SLACK and the chunk needs no
                 * max, no alpha and no rescale of the accumulators. */
                const __m512 m_ref = _mm512_permutexvar_ps(
                    lane_of_query, _mm512_castps128_ps512(_mm_loadu_ps(m + i0)));
                __m512 x[4];
                __mmask16 passed = 0;
                for (int a = 0; a < 4; a++) {
                    x[a] = _mm512_sub_ps(s4[a], _mm512_shuffle_f32x4(m_ref, m_ref, 0x55 * a));
                    passed |= _mm512_cmp_ps_mask(x[a], slack, _CMP_GT_OQ);
                }
                const int moved = passed != 0;
                __m512 al[4];
                if (moved) {
                    const __m512 m_new = _mm512_max_ps(m_ref, max4(s4));
                    const __m512 alpha = exp512(_mm512_sub_ps(m_ref, m_new));
                    _mm_storeu_ps(m + i0, _mm512_castps512_ps128(
                        _mm512_permutexvar_ps(first_of_lane, m_new)));
                    for (int a = 0; a < 4; a++) {
                        al[a] = _mm512_shuffle_f32x4(alpha, alpha, 0x55 * a);
                        x[a] = _mm512_sub_ps(s4[a], _mm512_shuffle_f32x4(m_new, m_new, 0x55 * a));
                    }
                }
                for (int a = 0; a < 4; a++) {
                    /* Masked lanes: exp512 of -1e30 is exactly 0. */
                    const __m512 e = exp512(x[a]);
#if DOT_BF16_
                    /* P rounded to bf16 for P @ V, as torch's CPU flash attention does in
                     * bf16; the denominator sums the unrounded exponentials (as there). */
                    _mm256_store_si256((__m256i*)pp[a], (__m256i)_mm512_cvtneps_pbh(e));
#else
                    _mm512_store_ps(p[a], e);
#endif
                    /* The denominator by lanes, summed once when the task ends. */
                    float* la = lv + (int64_t)(i0 + a) * 16;
                    _mm512_store_ps(la, moved ? _mm512_fmadd_ps(_mm512_load_ps(la), al[a], e)
                                              : _mm512_add_ps(_mm512_load_ps(la), e));
                }
                for (int dc = 0; dc < D; dc += 16 * NV_) {
                    __m512 o[4][NV_];
                    #pragma GCC unroll 4
                    for (int a = 0; a < 4; a++) {
                        #pragma GCC unroll 4
                        for (int c = 0; c < NV_; c++) {
                            o[a][c] = _mm512_load_ps(acc + (int64_t)(i0 + a) * D + dc + 16 * c);
                            if (moved) o[a][c] = _mm512_mul_ps(o[a][c], al[a]);
                        }
                    }
#if DOT_BF16_
                    /* Two keys per vdpbf16ps: lane d gets p[2p] v[2p][d] + p[2p+1] v[2p+1][d]. */
                    const uint32_t* vp = (const uint32_t*)vt;
                    for (int jp = 0; jp < (kn + 1) / 2; jp++) {
                        __m512bh vr[NV_];
                        #pragma GCC unroll 4
                        for (int c = 0; c < NV_; c++)
                            vr[c] = (__m512bh)_mm512_loadu_si512(vp + jp * D + dc + 16 * c);
                        #pragma GCC unroll 4
                        for (int a = 0; a < 4; a++) {
                            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)pp[a][jp]);
                            #pragma GCC unroll 4
                            for (int c = 0; c < NV_; c++) o[a][c] = _mm512_dpbf16_ps(o[a][c], x, vr[c]);
                        }
                    }
#else
                    /* P @ V stops at the last key a query of the tile sees: past it every
                     * p is exactly 0 (on the diagonal chunk, about half its keys). (Bounded
                     * so, the bf16 pairs' loop above was 2-5% slower on a Zen 4.) */
                    const int kv = last - j0 + 1 < kn ? last - j0 + 1 : kn;
                    for (int jj = 0; jj < kv; jj++) {
                        __m512 vr[NV_];
                        #pragma GCC unroll 4
                        for (int c = 0; c < NV_; c++) vr[c] = _mm512_load_ps(vt + jj * D + dc + 16 * c);
                        #pragma GCC unroll 4
                        for (int a = 0; a < 4; a++) {
                            const __m512 x = _mm512_set1_ps(p[a][jj]);
                            #pragma GCC unroll 4
                            for (int c = 0; c < NV_; c++) o[a][c] = _mm512_fmadd_ps(x, vr[c], o[a][c]);
                        }
                    }
#endif
                    #pragma GCC unroll 4
                    for (int a = 0; a < 4; a++) {
                        #pragma GCC unroll 4
                        for (int c = 0; c < NV_; c++)
                            _mm512_store_ps(acc + (int64_t)(i0 + a) * D + dc + 16 * c, o[a][c]);
                    }
                }
            }
        }
        for (int i = 0; i < nq; i++) l[i] = _mm512_reduce_add_ps(_mm512_load_ps(lv + (int64_t)i * 16));
        FINISH_TASK(out, acc, l, nq, r0, G, h, out_stride, D);
    }
    free(m); free(l); free(lv); free(acc); free(qs);
#if DOT_BF16_
    free(qp);
#endif
    }
    free(kts); free(vts);
}
#undef NV_
#undef DOT_BF16_
