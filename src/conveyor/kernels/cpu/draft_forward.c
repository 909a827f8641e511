/*
 * A draft model's whole proposal in one call: every forward of a Llama-family model over
 * decode rows, the LM head, the argmax, and the next position's input, for k drafts of
 * B requests, without returning to Python between them.
 *
 * Why: a draft model is ~10x smaller than its target, but run through eager PyTorch a
 * forward of a 2-layer draft costs ~0.3 ms on a 2-core Zen 5 whatever its size (module
 * calls, dispatch, tensor allocation: 25-odd Python-level calls per forward), a third of
 * the target's step; four drafts then cost more than the steps they save. GPU engines
 * replay CUDA graphs for this; on a CPU the same work is a loop in C over the kernels the
 * model already runs (gemm.c, elementwise.c, decode_attention.c), so every number is the
 * one the PyTorch path computes with native linears, in the same order.
 *
 * The model is passed as two tables (built and checked once in Python, kernels/ops.py's
 * DraftForward):
 *   dims [8]: hidden, layers, Hq, Hkv, D, intermediate, vocab, window (0: none)
 *   ptrs [5 + 9 * layers]: embedding [vocab, hidden], final norm, packed LM head, RoPE cos,
 *     sin [max_pos, D]; per layer: input norm, post-attention norm, packed QKV, QKV bias
 *     (or 0), packed O, packed gate/up (silu(gate) * up fused), packed down, K cache, V
 *     cache ([num_slots, Hkv, D] float32 each).
 *
 * Proposal (requests sorted by k, descending, so the rows still drafting at round r are
 * a prefix):
 *   round 0: each request's catch-up tokens (catch[i] >= 1 of them, the last ones of its
 *     context, ids in catch_ids, grouped by request) as decode rows at positions
 *     lens0[i] - catch[i] .. lens0[i] - 1, each attending up to itself; the last row's
 *     argmax is draft 1.
 *   round r >= 1: request i (ks[i] > r) feeds draft r at position lens0[i] + r - 1.
 *   slots [B, L]: each request's context slots (lens0[i] + ks[i] - 1 <= L).
 *   out [B, kmax]: the drafts (row i: its first ks[i] entries).
 * Every forward writes its K/V rows to the caches at the positions it feeds. Returns 0,
 * -1 if memory ran out, -2 if the GEMM is not built on this CPU.
 *
 * eps and the attention scale are the model's own floats (those the PyTorch path passes
 * its kernels), not computed here: under -ffast-math GCC compiles 1.f / sqrtf(D) to an
 * rsqrt estimate and one Newton step, whose last bit depends on the CPU's estimate table
 * (0x1.fffffep-4, not 0.125, for D = 64 on some x86 CPUs), and the attention rows, so
 * every K/V row past the first layer, then differ from PyTorch's.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int gemm_f32(const float* x, int lda, const float* wp, const float* bias, float* out,
             int ldo, int M, int N, int K, int gate_up);
int gemm_f32_available(void);
void rms_norm_f32(const float* x, const float* w, float* out, int rows, int dim, float eps);
void add_rms_norm_f32(const float* x, float* residual, const float* w, float* out, int rows,
                      int dim, float eps);
void rope_f32(float* qkv, const int64_t* pos, const float* cos_t, const float* sin_t, int T,
              int heads, int row_stride, int D);
void decode_attention_f32(const float* q, const float* kc, const float* vc,
                          const int64_t* slots, const int32_t* lens, const int32_t* starts,
                          float* out, int B, int Hq, int Hkv, int D, int L, float scale);

enum { D_HIDDEN, D_LAYERS, D_HQ, D_HKV, D_HEAD, D_INTER, D_VOCAB, D_WINDOW };
enum { P_EMBED, P_NORM, P_HEAD, P_COS, P_SIN, P_LAYER0 };
enum { L_IN_NORM, L_POST_NORM, L_QKV, L_QKV_BIAS, L_O, L_GATE_UP, L_DOWN, L_K, L_V, L_N };

typedef struct {
    float *h, *res, *x, *qkv, *q, *attn, *gu;
} buffers;

#define PTR(T, i) ((T)(intptr_t)ptrs[i])

/* One forward over R decode rows: ids, positions, the slot each row's K/V goes to, and
 * each row's attention (its context's slot row, length, window start). Leaves the final
 * normed hidden states in b->x. */
static int forward(const int64_t* dims, const int64_t* ptrs, float eps, float scale,
                   int R, const int64_t* ids, const int64_t* pos, const int64_t* wslot,
                   const int64_t* rslots, const int32_t* rlens, const int32_t* rstarts, int L,
                   buffers* b) {
    const int H = (int)dims[D_HIDDEN], Hq = (int)dims[D_HQ], Hkv = (int)dims[D_HKV];
    const int D = (int)dims[D_HEAD], I = (int)dims[D_INTER];
    const int qkv_w = (Hq + 2 * Hkv) * D, kv_w = Hkv * D;
    const float* embed = PTR(const float*, P_EMBED);
    for (int r = 0; r < R; r++)
        memcpy(b->res + (int64_t)r * H, embed + ids[r] * H, sizeof(float) * H);
    for (int l = 0; l < (int)dims[D_LAYERS]; l++) {
        const int64_t* lp = ptrs + P_LAYER0 + (int64_t)l * L_N;
        const float* in_norm = (const float*)(intptr_t)lp[L_IN_NORM];
        if (l == 0) rms_norm_f32(b->res, in_norm, b->x, R, H, eps);
        else add_rms_norm_f32(b->h, b->res, in_norm, b->x, R, H, eps);
        if (gemm_f32(b->x, H, (const float*)(intptr_t)lp[L_QKV],
                     (const float*)(intptr_t)lp[L_QKV_BIAS], b->qkv, qkv_w, R, qkv_w, H, 0))
            return -1;
        rope_f32(b->qkv, pos, PTR(const float*, P_COS), PTR(const float*, P_SIN), R,
                 Hq + Hkv, qkv_w, D);
        float* kc = (float*)(intptr_t)lp[L_K];
        float* vc = (float*)(intptr_t)lp[L_V];
        for (int r = 0; r < R; r++) {
            const float* row = b->qkv + (int64_t)r * qkv_w;
            memcpy(b->q + (int64_t)r * Hq * D, row, sizeof(float) * Hq * D);
            memcpy(kc + wslot[r] * kv_w, row + Hq * D, sizeof(float) * kv_w);
            memcpy(vc + wslot[r] * kv_w, row + (Hq + Hkv) * D, sizeof(float) * kv_w);
        }
        decode_attention_f32(b->q, kc, vc, rslots, rlens, rstarts, b->attn, R, Hq, Hkv, D, L,
                             scale);
        if (gemm_f32(b->attn, Hq * D, (const float*)(intptr_t)lp[L_O], NULL, b->h, H, R, H,
                     Hq * D, 0))
            return -1;
        add_rms_norm_f32(b->h, b->res, (const float*)(intptr_t)lp[L_POST_NORM], b->x, R, H,
                         eps);
        if (gemm_f32(b->x, H, (const float*)(intptr_t)lp[L_GATE_UP], NULL, b->gu, I, R,
                     2 * I, H, 1))
            return -1;
        if (gemm_f32(b->gu, I, (const float*)(intptr_t)lp[L_DOWN], NULL, b->h, H, R, H, I,
                     0))
            return -1;
    }
    add_rms_norm_f32(b->h, b->res, PTR(const float*, P_NORM), b->x, R, H, eps);
    return 0;
}

/* The LM head over the rows of b->x listed in sel (n of them), then each one's argmax
 * (the first of equal maxima, as torch.argmax) into out[i * ld + col]. */
static int head_argmax(const int64_t* dims, const int64_t* ptrs, buffers* b,
                       const int* sel, int n, float* logits, float* xs, int64_t* out,
                       int ld, int col) {
    const int H = (int)dims[D_HIDDEN], V = (int)dims[D_VOCAB];
    for (int i = 0; i < n; i++)
        memcpy(xs + (int64_t)i * H, b->x + (int64_t)sel[i] * H, sizeof(float) * H);
    if (gemm_f32(xs, H, PTR(const float*, P_HEAD), NULL, logits, V, n, V, H, 0)) return -1;
    for (int i = 0; i < n; i++) {
        const float* lr = logits + (int64_t)i * V;
        int best = 0;
        float bv = lr[0];
        for (int v = 1; v < V; v++)
            if (lr[v] > bv) { bv = lr[v]; best = v; }
        out[(int64_t)i * ld + col] = best;
    }
    return 0;
}

int draft_propose_f32(const int64_t* dims, const int64_t* ptrs, float eps, float scale,
                      int B, const int64_t* catch_ids, const int32_t* catch_n,
                      const int64_t* lens0, const int32_t* ks, const int64_t* slots, int L,
                      int64_t* out) {
    if (!gemm_f32_available()) return -2;
    const int H = (int)dims[D_HIDDEN], Hq = (int)dims[D_HQ], Hkv = (int)dims[D_HKV];
    const int D = (int)dims[D_HEAD], I = (int)dims[D_INTER], V = (int)dims[D_VOCAB];
    const int64_t window = dims[D_WINDOW];
    const int kmax = ks[0];
    int R = 0;
    for (int i = 0; i < B; i++) R += catch_n[i];
    const int rows = R > B ? R : B;
    const size_t per_row = (size_t)3 * H + (size_t)(Hq + 2 * Hkv) * D + 2 * (size_t)Hq * D
                           + I + H + V;
    float* mem = (float*)malloc(sizeof(float) * per_row * rows);
    int64_t* imem = (int64_t*)malloc(sizeof(int64_t) * ((size_t)rows * (L + 3)));
    int32_t* jmem = (int32_t*)malloc(sizeof(int32_t) * (size_t)rows * 2);
    int* sel = (int*)malloc(sizeof(int) * (size_t)rows);
    int rc = -1;
    if (!mem || !imem || !jmem || !sel) goto done;
    buffers b;
    float* p = mem;
    b.h = p; p += (size_t)rows * H;
    b.res = p; p += (size_t)rows * H;
    b.x = p; p += (size_t)rows * H;
    b.qkv = p; p += (size_t)rows * (Hq + 2 * Hkv) * D;
    b.q = p; p += (size_t)rows * Hq * D;
    b.attn = p; p += (size_t)rows * Hq * D;
    b.gu = p; p += (size_t)rows * I;
    float* xs = p; p += (size_t)rows * H;
    float* logits = p;
    int64_t* pos = imem;
    int64_t* wslot = imem + rows;
    int64_t* ids = imem + 2 * (size_t)rows;
    int64_t* rslots = imem + 3 * (size_t)rows;
    int32_t* rlens = jmem;
    int32_t* rstarts = jmem + rows;

    /* Round 0: the catch-up rows, each with its request's slot row. */
    int g = 0;
    for (int i = 0; i < B; i++) {
        const int c = catch_n[i];
        for (int j = 0; j < c; j++, g++) {
            const int64_t at = lens0[i] - c + j;
            ids[g] = catch_ids[g];
            pos[g] = at;
            wslot[g] = slots[(int64_t)i * L + at];
            rlens[g] = (int32_t)(at + 1);
            rstarts[g] = window > 0 && at + 1 > window ? (int32_t)(at + 1 - window) : 0;
            memcpy(rslots + (int64_t)g * L, slots + (int64_t)i * L, sizeof(int64_t) * L);
        }
        sel[i] = g - 1;
    }
    if ((rc = forward(dims, ptrs, eps, scale, R, ids, pos, wslot, rslots, rlens, rstarts, L,
                      &b)))
        goto done;
    if ((rc = head_argmax(dims, ptrs, &b, sel, B, logits, xs, out, kmax, 0))) goto done;

    /* Rounds 1..kmax-1: the rows still drafting feed their last draft. Their slot rows
     * are the first m rows of slots, as they are. */
    for (int r = 1; r < kmax; r++) {
        int m = 0;
        while (m < B && ks[m] > r) m++;
        for (int i = 0; i < m; i++) {
            const int64_t at = lens0[i] + r - 1;
            ids[i] = out[(int64_t)i * kmax + r - 1];
            pos[i] = at;
            wslot[i] = slots[(int64_t)i * L + at];
            rlens[i] = (int32_t)(at + 1);
            rstarts[i] = window > 0 && at + 1 > window ? (int32_t)(at + 1 - window) : 0;
            sel[i] = i;
        }
        if ((rc = forward(dims, ptrs, eps, scale, m, ids, pos, wslot, slots, rlens, rstarts,
                          L, &b)))
            goto done;
        if ((rc = head_argmax(dims, ptrs, &b, sel, m, logits, xs, out, kmax, r))) goto done;
    }
    rc = 0;
done:
    free(mem);
    free(imem);
    free(jmem);
    free(sel);
    return rc;
}
