/*
 * A mixture-of-experts block's routing after the router's softmax, and its combine, as
 * two calls instead of a dozen torch ops a layer (moe_route.py holds the glue).
 *
 * moe_route_f32: each row's top-k experts (optionally renormalised weights), the
 * (slot, token) pairs grouped by expert in transformers' order (expert ascending, then
 * slot, then token) and each pair's row of x gathered, ready for the grouped GEMMs.
 * moe_combine_f32: the pairs' expert outputs scaled by their weights and added into
 * their tokens' rows in pair order (expert after expert), as transformers' index_add_
 * does.
 *
 * Built with IEEE arithmetic as written (-fno-fast-math -ffp-contract=off: a product and
 * a sum are rounded apart, never one FMA), so every value is the bits torch computes: the
 * renormalising sum adds a row's k weights left to right as torch's sum over a short
 * last dimension does, then divides. The top-k order of tied probabilities is torch's
 * implementation's own; where a row's k-th and (k+1)-th probabilities tie (or a row
 * holds a NaN) the choice of expert would depend on it, so the call declines (returns 1)
 * and the caller takes torch's topk. Ties inside a row's top k change nothing: the
 * weights are equal and a pair's row computes alike wherever it sits in its expert's
 * rows.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MOE_MAX_K 32

int moe_route_max_k(void) { return MOE_MAX_K; }

/*
 * probs: [T, E] float32, rows ldp apart (the softmax's output); x: [T, H] rows ldx apart.
 * Out: top_ids [T, k] int32 and top_w [T, k] float32 (descending, renormalised when
 * asked), starts [E + 1] int32 (expert e's pairs are rows starts[e] .. starts[e + 1] - 1
 * of the grouped arrays), and per pair (T * k of them): tokens int32, pair_w float32,
 * rows [T * k, H] float32 (contiguous: x's rows gathered).
 * Returns 0; 1 where the choice would follow a tie or a NaN (nothing usable is written);
 * -1 on bad arguments or out of memory.
 */
int moe_route_f32(int T, int E, int k, const float* probs, int64_t ldp, int renormalize,
                  const float* x, int64_t ldx, int H, int32_t* top_ids, float* top_w,
                  int32_t* starts, int32_t* tokens, float* pair_w, float* rows) {
    if (T < 0 || E < 1 || k < 1 || k > E || k > MOE_MAX_K || H < 0) return -1;
    int32_t* cursor = (int32_t*)calloc((size_t)E, sizeof(int32_t));
    if (cursor == NULL) return -1;
    for (int t = 0; t < T; t++) {
        const float* p = probs + (int64_t)t * ldp;
        /* the k + 1 largest, descending; an equal value goes after those already in */
        float v[MOE_MAX_K + 1];
        int id[MOE_MAX_K + 1];
        const int keep = k < E ? k + 1 : k;
        int n = 0;
        for (int e = 0; e < E; e++) {
            const float pe = p[e];
            if (pe != pe) {
                free(cursor);
                return 1;
            }
            if (n == keep && !(pe > v[n - 1])) continue;
            int i = n < keep ? n++ : n - 1;
            while (i > 0 && v[i - 1] < pe) {
                v[i] = v[i - 1];
                id[i] = id[i - 1];
                i--;
            }
            v[i] = pe;
            id[i] = e;
        }
        if (keep > k && v[k] == v[k - 1]) {
            free(cursor);
            return 1;
        }
        float* w = top_w + (int64_t)t * k;
        int32_t* ids = top_ids + (int64_t)t * k;
        for (int s = 0; s < k; s++) {
            w[s] = v[s];
            ids[s] = id[s];
            cursor[id[s]]++;
        }
        if (renormalize) {
            float sum = w[0];
            for (int s = 1; s < k; s++) sum = sum + w[s];
            for (int s = 0; s < k; s++) w[s] = w[s] / sum;
        }
    }
    starts[0] = 0;
    for (int e = 0; e < E; e++) {
        starts[e + 1] = starts[e] + cursor[e];
        cursor[e] = starts[e];
    }
    for (int s = 0; s < k; s++)
        for (int t = 0; t < T; t++) {
            const int e = top_ids[(int64_t)t * k + s];
            const int64_t at = cursor[e]++;
            tokens[at] = t;
            pair_w[at] = top_w[(int64_t)t * k + s];
            memcpy(rows + at * H, x + (int64_t)t * ldx, sizeof(float) * (size_t)H);
        }
    free(cursor);
    return 0;
}

/*
 * out [T, H] (contiguous) = 0, then for each pair p in order: out[tokens[p]] +=
 * h[p] * pair_w[p], the product rounded before the sum. h: [P, H] rows ldh apart.
 * Returns 0, or -1 where a token is outside 0 .. T - 1.
 */
int moe_combine_f32(int T, int H, int P, const float* h, int64_t ldh, const int32_t* tokens,
                    const float* pair_w, float* out) {
    memset(out, 0, sizeof(float) * (size_t)T * (size_t)H);
    for (int p = 0; p < P; p++)
        if (tokens[p] < 0 || tokens[p] >= T) return -1;
    for (int p = 0; p < P; p++) {
        const float w = pair_w[p];
        const float* hp = h + (int64_t)p * ldh;
        float* o = out + (int64_t)tokens[p] * H;
        for (int j = 0; j < H; j++) o[j] = o[j] + hp[j] * w;
    }
    return 0;
}
