/*
 * The portable body of prefill_attention.c's kernel, included once per element type and
 * head dim (TIN, LOAD, START_TASK, FINISH_TASK, D and NAME defined), so that each copy is
 * compiled with its dimension fixed.
 */
static void NAME(const TIN* restrict q, const TIN* restrict k, const TIN* restrict v,
                 TIN* restrict out, int L, int Hq, int Hkv, int q_stride, int kv_stride,
                 int out_stride, float scale, float softcap) {
    const int G = Hq / Hkv;
    const int nblocks = (L + QB - 1) / QB;
    const int ntasks = Hkv * nblocks;
    #pragma omp parallel if (!omp_in_parallel()) /* (inactive inside a varlen call) */
    {
    const int nq_max = (QB * G + 3) / 4 * 4;
    float* kt = (float*)aligned_alloc(64, sizeof(float) * D * KC);
    float* s = (float*)aligned_alloc(64, sizeof(float) * (size_t)nq_max * KC);
    float* m = (float*)malloc(sizeof(float) * (size_t)nq_max);
    float* l = (float*)malloc(sizeof(float) * (size_t)nq_max);
    float* acc = (float*)aligned_alloc(64, sizeof(float) * (size_t)nq_max * D);
    float* qs = (float*)aligned_alloc(64, sizeof(float) * (size_t)nq_max * D);
    /* Largest blocks first (their work grows with the row index). */
    #pragma omp for schedule(dynamic, 1)
    for (int task = 0; task < ntasks; task++) {
        const int blk = nblocks - 1 - task / Hkv, h = task % Hkv;
        const int r0 = blk * QB, r1 = r0 + QB < L ? r0 + QB : L;
        const int nq = (r1 - r0) * G, nq4 = (nq + 3) / 4 * 4;
        START_TASK(q, qs, m, l, acc, nq, nq4, r0, G, h, q_stride, D, scale);
        for (int j0 = 0; j0 < r1; j0 += KC) {
            const int kn = r1 - j0 < KC ? r1 - j0 : KC;
            for (int jj = 0; jj < KC; jj++) {
                const TIN* kr = k + (int64_t)(j0 + (jj < kn ? jj : 0)) * kv_stride
                                + (int64_t)h * D;
                for (int d = 0; d < D; d++) kt[d * KC + jj] = LOAD(kr[d]);
            }
            for (int i0 = 0; i0 < nq; i0 += 4) {
                if (r0 + (i0 + 3 < nq ? i0 + 3 : nq - 1) / G < j0) continue;
                float sc0[KC] = {0}, sc1[KC] = {0}, sc2[KC] = {0}, sc3[KC] = {0};
                const float* q0 = qs + (int64_t)i0 * D;
                for (int d = 0; d < D; d++) {
                    const float* kd = kt + d * KC;
                    const float x0 = q0[d], x1 = q0[D + d], x2 = q0[2 * D + d],
                                x3 = q0[3 * D + d];
                    #pragma omp simd
                    for (int jj = 0; jj < KC; jj++) {
                        sc0[jj] += x0 * kd[jj]; sc1[jj] += x1 * kd[jj];
                        sc2[jj] += x2 * kd[jj]; sc3[jj] += x3 * kd[jj];
                    }
                }
                float* scs[4] = {sc0, sc1, sc2, sc3};
                for (int a = 0; a < 4 && i0 + a < nq; a++) {
                    const int i = i0 + a, t = r0 + i / G;
                    float* sc = scs[a];
                    if (softcap > 0.f) softcap_scores(sc, KC, softcap); /* before the mask */
                    float* si = s + (int64_t)i * KC;
                    const int valid = t < j0 ? 0 : (t - j0 + 1 < kn ? t - j0 + 1 : kn);
                    for (int jj = valid; jj < KC; jj++) sc[jj] = NEG;
                    float cm = m[i];
                    for (int jj = 0; jj < KC; jj++) cm = sc[jj] > cm ? sc[jj] : cm;
                    const float alpha = expf(m[i] - cm);
                    float sum = 0.f;
                    #pragma omp simd reduction(+:sum)
                    for (int jj = 0; jj < KC; jj++) {
                        const float p = expf(sc[jj] - cm);
                        si[jj] = p;
                        sum += p;
                    }
                    l[i] = l[i] * alpha + sum;
                    m[i] = cm;
                    /* Rescale and add this chunk's V rows with the accumulator in registers. */
                    float a_[D];
                    const float* ai = acc + (int64_t)i * D;
                    for (int d = 0; d < D; d++) a_[d] = ai[d] * alpha;
                    for (int jj = 0; jj < valid; jj++) {
                        const float p = si[jj];
                        const TIN* vr = v + (int64_t)(j0 + jj) * kv_stride + (int64_t)h * D;
                        #pragma omp simd
                        for (int d = 0; d < D; d++) a_[d] += p * LOAD(vr[d]);
                    }
                    float* aw = acc + (int64_t)i * D;
                    for (int d = 0; d < D; d++) aw[d] = a_[d];
                }
            }
        }
        FINISH_TASK(out, acc, l, nq, r0, G, h, out_stride, D);
    }
    free(kt); free(s); free(m); free(l); free(acc); free(qs);
    }
}

