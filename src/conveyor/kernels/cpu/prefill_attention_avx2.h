/*
 * The AVX2 + FMA body of prefill_attention.c's kernel, included once per element type and
 * head dim (TIN, LOAD, START_TASK, FINISH_TASK, D (a multiple of 16) and NAME defined);
 * same task split and online softmax as the portable body (prefill_attention_body.h),
 * with both products register-blocked:
 *
 *   scores  4 queries x KC (16) keys in 8 ymm accumulators; a step over d is two loads of
 *           the transposed K tile, four broadcasts and eight FMAs
 *   P @ V   4 queries x 16 dims of the output in 8 ymm accumulators, rescaled once per
 *           chunk; a key is two loads of its V row (copied into a compact tile), four
 *           broadcasts of the probabilities and eight FMAs
 *
 * and the K and V tiles built once per call, shared by every query block.
 * where the portable body reloaded each query's accumulator and every V row once per
 * query (measured 2-3x slower on the 2-core AVX2 machine this project runs on).
 */
#ifndef CONVEYOR_MAX4_AVX2_
#define CONVEYOR_MAX4_AVX2_
/* The maxima of four registers in one: a fold across 128-bit halves, one within them,
 * one of neighbours; query 0's maximum lands in lanes 0-1, 2's in 2-3, 1's in 4-5 and 3's
 * in 6-7 (5 shuffles and 3 maxes for four queries, where reducing each took 3 and 3). */
static inline __m256 max4_avx2(const __m256 x[4]) {
    const __m256 u = _mm256_max_ps(_mm256_permute2f128_ps(x[0], x[1], 0x20),
                                   _mm256_permute2f128_ps(x[0], x[1], 0x31));
    const __m256 w = _mm256_max_ps(_mm256_permute2f128_ps(x[2], x[3], 0x20),
                                   _mm256_permute2f128_ps(x[2], x[3], 0x31));
    const __m256 y = _mm256_max_ps(_mm256_shuffle_ps(u, w, 0x44), _mm256_shuffle_ps(u, w, 0xEE));
    return _mm256_max_ps(y, _mm256_shuffle_ps(y, y, 0xB1));
}
#endif
static void NAME(const TIN* restrict q, const TIN* restrict k, const TIN* restrict v,
                 TIN* restrict out, int L, int Hq, int Hkv, int q_stride, int kv_stride,
                 int out_stride, float scale, float softcap) {
    const int G = Hq / Hkv;
    const int nblocks = (L + QB - 1) / QB;
    const int ntasks = Hkv * nblocks;
    /* Every KC-key chunk of every KV head, K transposed into [D][KC] and V copied into
     * [KC][D] (zeros past L), once per call rather than once per query block. */
    const int nchunks = (L + KC - 1) / KC;
    float* kts = (float*)aligned_alloc(64, sizeof(float) * (size_t)Hkv * nchunks * D * KC);
    float* vts = (float*)aligned_alloc(64, sizeof(float) * (size_t)Hkv * nchunks * KC * D);
    #pragma omp parallel if (!omp_in_parallel()) /* (inactive inside a varlen call) */
    {
    #pragma omp for schedule(static)
    for (int c = 0; c < Hkv * nchunks; c++) {
        const int h = c / nchunks, j0 = (c % nchunks) * KC;
        const int kn = L - j0 < KC ? L - j0 : KC;
        TILE_CHUNK(k, v, kts + (int64_t)c * D * KC, vts + (int64_t)c * KC * D, j0, kn, h,
                   kv_stride, D);
    }
    const int nq_max = (QB * G + 3) / 4 * 4;
    float* m = (float*)malloc(sizeof(float) * (size_t)nq_max);
    float* l = (float*)malloc(sizeof(float) * (size_t)nq_max);
    float* acc = (float*)aligned_alloc(64, sizeof(float) * (size_t)nq_max * D);
    float* lv = (float*)aligned_alloc(64, sizeof(float) * (size_t)nq_max * 8);
    float* qs = (float*)aligned_alloc(64, sizeof(float) * (size_t)nq_max * D);
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    /* Largest blocks first (their work grows with the row index). */
    #pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < ntasks; task++) {
        const int blk = nblocks - 1 - task / Hkv, h = task % Hkv;
        const int r0 = blk * QB, r1 = r0 + QB < L ? r0 + QB : L;
        const int nq = (r1 - r0) * G, nq4 = (nq + 3) / 4 * 4;
        START_TASK(q, qs, m, l, acc, nq, nq4, r0, G, h, q_stride, D, scale);
        memset(lv, 0, sizeof(float) * (size_t)nq4 * 8);
        for (int j0 = 0; j0 < r1; j0 += KC) {
            const int kn = r1 - j0 < KC ? r1 - j0 : KC;
            const float* kt = kts + ((int64_t)h * nchunks + j0 / KC) * D * KC;
            const float* vt = vts + ((int64_t)h * nchunks + j0 / KC) * KC * D;
            for (int i0 = 0; i0 < nq; i0 += 4) {
                const int last = r0 + (i0 + 3 < nq ? i0 + 3 : nq - 1) / G; /* tile's last row */
                if (last < j0) continue;
                /* P @ V stops at the last key a query of the tile sees: past it every p is
                 * exactly 0 (on the diagonal chunk, about half its keys) */
                const int kv = last - j0 + 1 < kn ? last - j0 + 1 : kn;
                const float* q0 = qs + (int64_t)i0 * D;
                __m256 s00 = _mm256_setzero_ps(), s01 = s00, s10 = s00, s11 = s00,
                       s20 = s00, s21 = s00, s30 = s00, s31 = s00;
                for (int d = 0; d < D; d++) {
                    const __m256 k0 = _mm256_load_ps(kt + d * KC);
                    const __m256 k1 = _mm256_load_ps(kt + d * KC + 8);
                    __m256 x = _mm256_broadcast_ss(q0 + d);
                    s00 = _mm256_fmadd_ps(x, k0, s00); s01 = _mm256_fmadd_ps(x, k1, s01);
                    x = _mm256_broadcast_ss(q0 + D + d);
                    s10 = _mm256_fmadd_ps(x, k0, s10); s11 = _mm256_fmadd_ps(x, k1, s11);
                    x = _mm256_broadcast_ss(q0 + 2 * D + d);
                    s20 = _mm256_fmadd_ps(x, k0, s20); s21 = _mm256_fmadd_ps(x, k1, s21);
                    x = _mm256_broadcast_ss(q0 + 3 * D + d);
                    s30 = _mm256_fmadd_ps(x, k0, s30); s31 = _mm256_fmadd_ps(x, k1, s31);
                }
                float p[4][KC] __attribute__((aligned(32)));
                __m256 e_sum[4];
                _mm256_store_ps(p[0], s00); _mm256_store_ps(p[0] + 8, s01);
                _mm256_store_ps(p[1], s10); _mm256_store_ps(p[1] + 8, s11);
                _mm256_store_ps(p[2], s20); _mm256_store_ps(p[2] + 8, s21);
                _mm256_store_ps(p[3], s30); _mm256_store_ps(p[3] + 8, s31);
                /* Soft-capped logits (softcap.h) before the mask. */
                if (softcap > 0.f) softcap_scores(p[0], 4 * KC, softcap);
                /* Keys past row t (and padding) are masked; padded queries mask all. */
                __m256 lo[4], hi[4], mx[4];
                for (int a = 0; a < 4; a++) {
                    const int i = i0 + a, t = r0 + i / G;
                    const int valid = i >= nq || t < j0 ? 0 : (t - j0 + 1 < kn ? t - j0 + 1 : kn);
                    const __m256i nv = _mm256_set1_epi32(valid);
                    const __m256 neg = _mm256_set1_ps(NEG);
                    lo[a] = _mm256_blendv_ps(neg, _mm256_load_ps(p[a]),
                                             _mm256_castsi256_ps(_mm256_cmpgt_epi32(nv, lane)));
                    hi[a] = _mm256_blendv_ps(neg, _mm256_load_ps(p[a] + 8),
                                             _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                                                 nv, _mm256_add_epi32(lane, _mm256_set1_epi32(8)))));
                    mx[a] = _mm256_max_ps(lo[a], hi[a]);
                }
                /* Each query's reference max moves only when a score passes it by more
                 * than SLACK (on its first chunk, from NEG, it always does): then the
                 * four maxima by one fold (max4_avx2: query 0 in lane 0, 1 in lane 4, 2 in
                 * lane 2, 3 in lane 6) and the rescales alpha = e^(old max - new), as
                 * online softmax has them. Else the weights stay within e^SLACK and the
                 * chunk needs no max, no alpha and no rescale of the accumulators. */
                __m256 xlo[4], xhi[4];
                int moved = 0;
                for (int a = 0; a < 4; a++) {
                    const __m256 ref = _mm256_set1_ps(m[i0 + a]);
                    xlo[a] = _mm256_sub_ps(lo[a], ref);
                    xhi[a] = _mm256_sub_ps(hi[a], ref);
                    moved |= _mm256_movemask_ps(_mm256_or_ps(
                        _mm256_cmp_ps(xlo[a], _mm256_set1_ps(SLACK), _CMP_GT_OQ),
                        _mm256_cmp_ps(xhi[a], _mm256_set1_ps(SLACK), _CMP_GT_OQ)));
                }
                float alpha[4] = {1.f, 1.f, 1.f, 1.f};
                if (moved) {
                    float qmax[8] __attribute__((aligned(32)));
                    _mm256_store_ps(qmax, max4_avx2(mx));
                    float al[8] __attribute__((aligned(32))) = {0.f};
                    for (int a = 0; a < 4; a++) {
                        const float cm = fmaxf(m[i0 + a], qmax[(a & 1) * 4 + (a >> 1) * 2]);
                        al[a] = m[i0 + a] - cm; /* exponentiated below, the four at once */
                        m[i0 + a] = cm;
                        xlo[a] = _mm256_sub_ps(lo[a], _mm256_set1_ps(cm));
                        xhi[a] = _mm256_sub_ps(hi[a], _mm256_set1_ps(cm));
                    }
                    _mm256_store_ps(al, exp256(_mm256_load_ps(al)));
                    for (int a = 0; a < 4; a++) alpha[a] = al[a];
                }
                for (int a = 0; a < 4; a++) {
                    /* Masked lanes: exp256 of -1e30 is exactly 0. */
                    const __m256 elo = exp256(xlo[a]), ehi = exp256(xhi[a]);
                    _mm256_store_ps(p[a], elo);
                    _mm256_store_ps(p[a] + 8, ehi);
                    e_sum[a] = _mm256_add_ps(elo, ehi);
                }
                /* The denominators by lanes, summed once when the task ends. */
                for (int a = 0; a < 4; a++) {
                    float* la = lv + (int64_t)(i0 + a) * 8;
                    _mm256_store_ps(la, moved ? _mm256_fmadd_ps(_mm256_load_ps(la),
                                                                _mm256_set1_ps(alpha[a]), e_sum[a])
                                              : _mm256_add_ps(_mm256_load_ps(la), e_sum[a]));
                }
                const __m256 al0 = _mm256_set1_ps(alpha[0]), al1 = _mm256_set1_ps(alpha[1]),
                             al2 = _mm256_set1_ps(alpha[2]), al3 = _mm256_set1_ps(alpha[3]);
                for (int dc = 0; dc < D; dc += 16) {
                    float* a0 = acc + (int64_t)i0 * D + dc;
                    __m256 o00 = _mm256_load_ps(a0), o01 = _mm256_load_ps(a0 + 8);
                    __m256 o10 = _mm256_load_ps(a0 + D), o11 = _mm256_load_ps(a0 + D + 8);
                    __m256 o20 = _mm256_load_ps(a0 + 2 * D), o21 = _mm256_load_ps(a0 + 2 * D + 8);
                    __m256 o30 = _mm256_load_ps(a0 + 3 * D), o31 = _mm256_load_ps(a0 + 3 * D + 8);
                    if (moved) {
                        o00 = _mm256_mul_ps(o00, al0); o01 = _mm256_mul_ps(o01, al0);
                        o10 = _mm256_mul_ps(o10, al1); o11 = _mm256_mul_ps(o11, al1);
                        o20 = _mm256_mul_ps(o20, al2); o21 = _mm256_mul_ps(o21, al2);
                        o30 = _mm256_mul_ps(o30, al3); o31 = _mm256_mul_ps(o31, al3);
                    }
                    for (int jj = 0; jj < kv; jj++) {
                        const __m256 v0 = _mm256_load_ps(vt + jj * D + dc);
                        const __m256 v1 = _mm256_load_ps(vt + jj * D + dc + 8);
                        __m256 x = _mm256_broadcast_ss(&p[0][jj]);
                        o00 = _mm256_fmadd_ps(x, v0, o00); o01 = _mm256_fmadd_ps(x, v1, o01);
                        x = _mm256_broadcast_ss(&p[1][jj]);
                        o10 = _mm256_fmadd_ps(x, v0, o10); o11 = _mm256_fmadd_ps(x, v1, o11);
                        x = _mm256_broadcast_ss(&p[2][jj]);
                        o20 = _mm256_fmadd_ps(x, v0, o20); o21 = _mm256_fmadd_ps(x, v1, o21);
                        x = _mm256_broadcast_ss(&p[3][jj]);
                        o30 = _mm256_fmadd_ps(x, v0, o30); o31 = _mm256_fmadd_ps(x, v1, o31);
                    }
                    _mm256_store_ps(a0, o00); _mm256_store_ps(a0 + 8, o01);
                    _mm256_store_ps(a0 + D, o10); _mm256_store_ps(a0 + D + 8, o11);
                    _mm256_store_ps(a0 + 2 * D, o20); _mm256_store_ps(a0 + 2 * D + 8, o21);
                    _mm256_store_ps(a0 + 3 * D, o30); _mm256_store_ps(a0 + 3 * D + 8, o31);
                }
            }
        }
        for (int i = 0; i < nq; i++) {
            __m256 sv = _mm256_load_ps(lv + (int64_t)i * 8);
            sv = _mm256_add_ps(sv, _mm256_permute2f128_ps(sv, sv, 1));
            sv = _mm256_add_ps(sv, _mm256_shuffle_ps(sv, sv, 0x4e));
            l[i] = _mm256_cvtss_f32(_mm256_add_ps(sv, _mm256_shuffle_ps(sv, sv, 0xb1)));
        }
        FINISH_TASK(out, acc, l, nq, r0, G, h, out_stride, D);
    }
    free(m); free(l); free(lv); free(acc); free(qs);
    }
    free(kts); free(vts);
}
