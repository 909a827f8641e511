/*
 * A target model's whole decode forward in one call: every layer of a Llama-family model
 * (Llama, Mistral, Qwen2's QKV bias, Qwen3's per-head q/k norms) over R decode rows, from the embedded rows to the
 * final norm, on the kernels the PyTorch path calls one by one (elementwise.c, gemm.c,
 * decode_attention.c, and quant_gemm.c's qgemm_f32, qgemm_a16 or qgemm_a16_i8 through function pointers:
 * that one is a library of its own), in the same order, so every number is the one it
 * computes.
 *
 * Why: at a few rows a step is ~300 kernel calls, each paying for Python, ctypes and a
 * torch allocation besides its OpenMP region; here they cost a C call each.
 *
 * The model is passed as tables (built and checked once in Python, runner/fused_decode.py):
 *   dims [6]: hidden, layers, Hq, Hkv, D, intermediate
 *   ptrs [3 + layers * (6 + 4 * LIN_N)]: RoPE cos, sin [max_pos, D], the final norm; per
 *     layer: input norm, post-attention norm, K cache, V cache ([num_slots, Hkv, D]
 *     float32 each), the q and k norms over each head's D values (0: none; before the
 *     rotation, as NativeOps.head_norms_rope_), then the QKV, O, gate/up and down
 *     linears, LIN_N entries each (LIN_* below).
 * A linear is float32 or bf16 weights packed for gemm.c (gemm_f32, gemm_f32_w16) or an
 * int8 / int4 weight packed for quant_gemm.c (qgemm_f32, or qgemm_a16's int4 / qgemm_a16_i8's
 * int8 column pairs); "fused": the gate/up linear applies silu(gate) * up itself (else silu_mul_f32
 * follows it).
 *
 * A step: h [R, H] the embedded rows (overwritten), pos [R], wslot [R] (each row's K/V
 * slot), slots [R, L], lens, starts [R] (its attention, as the runner builds them);
 * out [R, H]: the final normed hidden states. Returns 0, -1 if memory ran out, -2 if a
 * GEMM is not built here, -3 if a linear's kind is unknown.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int gemm_f32(const float* x, int lda, const float* wp, const float* bias, float* out,
             int ldo, int M, int N, int K, int gate_up);
int gemm_f32_w16(const float* x, int lda, const uint16_t* wp, const float* bias, float* out,
                 int ldo, int M, int N, int K, int gate_up);
int gemm_f32_available(void);
void rms_norm_f32(const float* x, const float* w, float* out, int rows, int dim, float eps);
void add_rms_norm_f32(const float* x, float* residual, const float* w, float* out, int rows,
                      int dim, float eps);
void silu_mul_f32(const float* gu, float* out, int rows, int inter);
void rope_f32(float* qkv, const int64_t* pos, const float* cos_t, const float* sin_t, int T,
              int heads, int row_stride, int D);
void decode_attention_f32(const float* q, const float* kc, const float* vc,
                          const int64_t* slots, const int32_t* lens, const int32_t* starts,
                          float* out, int B, int Hq, int Hkv, int D, int L, float scale);

typedef int (*qgemm_fn)(const float* x, int M, int K, int ldx, const void* w, int bits, int N,
                        const float* scales, const float* zeros, int group,
                        const float* bias, float* y, int ldy, int glu);
typedef int (*a16_fn)(const float* x, int M, int K, int ldx, const void* w, int N,
                      const float* scales, const float* zeros, int group, const float* bias,
                      float* y, int ldy);

enum { D_HIDDEN, D_LAYERS, D_HQ, D_HKV, D_HEAD, D_INTER };
enum { P_COS, P_SIN, P_NORM, P_LAYER0 };
enum { L_IN_NORM, L_POST_NORM, L_K, L_V, L_Q_NORM, L_K_NORM, L_N_HEAD };
/* a linear: kind, packed weight, bias (0: none), N, K, fused activation, then for the
 * quantized kinds: bits, scales, zeros (0: none), group, the kernel (a function of
 * quant_gemm.c: qgemm_f32 for KIND_Q, qgemm_a16 or qgemm_a16_i8 for KIND_A16) */
enum { LIN_KIND, LIN_W, LIN_BIAS, LIN_N_OUT, LIN_K, LIN_FUSED, LIN_BITS, LIN_SCALES,
       LIN_ZEROS, LIN_GROUP, LIN_FN, LIN_N };
enum { KIND_F32, KIND_W16, KIND_Q, KIND_A16 };
enum { LIN_QKV, LIN_O, LIN_GATE_UP, LIN_DOWN };
#define LAYER_N (L_N_HEAD + 4 * LIN_N)

#define P(T, v) ((T)(intptr_t)(v))

/* y [R, ldy] = x [R, ldx] through the linear lp (its output width: N, or N / 2 fused). */
static int linear(const int64_t* lp, const float* x, int ldx, float* y, int ldy, int R) {
    const int N = (int)lp[LIN_N_OUT], K = (int)lp[LIN_K], fused = (int)lp[LIN_FUSED];
    switch ((int)lp[LIN_KIND]) {
    case KIND_F32:
        return gemm_f32(x, ldx, P(const float*, lp[LIN_W]), P(const float*, lp[LIN_BIAS]),
                        y, ldy, R, N, K, fused) ? -1 : 0;
    case KIND_W16:
        return gemm_f32_w16(x, ldx, P(const uint16_t*, lp[LIN_W]),
                            P(const float*, lp[LIN_BIAS]), y, ldy, R, N, K, fused) ? -1 : 0;
    case KIND_Q: {
        const int rc = P(qgemm_fn, lp[LIN_FN])(
            x, R, K, ldx, P(const void*, lp[LIN_W]), (int)lp[LIN_BITS], N,
            P(const float*, lp[LIN_SCALES]), P(const float*, lp[LIN_ZEROS]),
            (int)lp[LIN_GROUP], P(const float*, lp[LIN_BIAS]), y, ldy, fused);
        return rc == -2 ? -1 : rc ? -3 : 0;
    }
    case KIND_A16: {
        if (fused) return -3; /* (qgemm_a16 applies no activation) */
        const int rc = P(a16_fn, lp[LIN_FN])(
            x, R, K, ldx, P(const void*, lp[LIN_W]), N, P(const float*, lp[LIN_SCALES]),
            P(const float*, lp[LIN_ZEROS]), (int)lp[LIN_GROUP], P(const float*, lp[LIN_BIAS]),
            y, ldy);
        return rc == -2 ? -1 : rc ? -3 : 0;
    }
    default:
        return -3;
    }
}

int decode_forward_f32(const int64_t* dims, const int64_t* ptrs, float eps,
                       float scale, int R, float* h, const int64_t* pos,
                       const int64_t* wslot, const int64_t* slots, const int32_t* lens,
                       const int32_t* starts, int L, float* out) {
    if (!gemm_f32_available()) return -2;
    if (R <= 0) return 0;
    const int H = (int)dims[D_HIDDEN], Hq = (int)dims[D_HQ], Hkv = (int)dims[D_HKV];
    const int D = (int)dims[D_HEAD], I = (int)dims[D_INTER];
    const int qkv_w = (Hq + 2 * Hkv) * D, kv_w = Hkv * D;
    /* residual, normed x, qkv, q, attention out, gate/up (2I: unfused), its silu */
    const size_t per_row = (size_t)2 * H + qkv_w + 2 * (size_t)Hq * D + 3 * (size_t)I;
    float* mem = (float*)malloc(sizeof(float) * per_row * R);
    if (!mem) return -1;
    float* res = mem;
    float* x = res + (size_t)R * H;
    float* qkv = x + (size_t)R * H;
    float* q = qkv + (size_t)R * qkv_w;
    float* attn = q + (size_t)R * Hq * D;
    float* gu = attn + (size_t)R * Hq * D;
    float* act = gu + (size_t)R * 2 * I;
    int rc = 0;
    for (int l = 0; l < (int)dims[D_LAYERS] && !rc; l++) {
        const int64_t* lp = ptrs + P_LAYER0 + (int64_t)l * LAYER_N;
        const int64_t* lin = lp + L_N_HEAD;
        /* layer 0: the residual stream starts as the embedded rows */
        if (l == 0) {
            memcpy(res, h, sizeof(float) * (size_t)R * H);
            rms_norm_f32(res, P(const float*, lp[L_IN_NORM]), x, R, H, eps);
        } else {
            add_rms_norm_f32(h, res, P(const float*, lp[L_IN_NORM]), x, R, H, eps);
        }
        if ((rc = linear(lin + LIN_QKV * LIN_N, x, H, qkv, qkv_w, R))) break;
        const float* qn = P(const float*, lp[L_Q_NORM]);
        const float* kn = P(const float*, lp[L_K_NORM]);
        for (int r = 0; qn && r < R; r++) { /* in place: a row's heads are contiguous */
            float* row = qkv + (size_t)r * qkv_w;
            rms_norm_f32(row, qn, row, Hq, D, eps);
            rms_norm_f32(row + Hq * D, kn, row + Hq * D, Hkv, D, eps);
        }
        rope_f32(qkv, pos, P(const float*, ptrs[P_COS]), P(const float*, ptrs[P_SIN]), R,
                 Hq + Hkv, qkv_w, D);
        float* kc = P(float*, lp[L_K]);
        float* vc = P(float*, lp[L_V]);
        for (int r = 0; r < R; r++) {
            const float* row = qkv + (size_t)r * qkv_w;
            memcpy(q + (size_t)r * Hq * D, row, sizeof(float) * Hq * D);
            memcpy(kc + wslot[r] * kv_w, row + Hq * D, sizeof(float) * kv_w);
            memcpy(vc + wslot[r] * kv_w, row + (Hq + Hkv) * D, sizeof(float) * kv_w);
        }
        decode_attention_f32(q, kc, vc, slots, lens, starts, attn, R, Hq, Hkv, D, L, scale);
        if ((rc = linear(lin + LIN_O * LIN_N, attn, Hq * D, h, H, R))) break;
        add_rms_norm_f32(h, res, P(const float*, lp[L_POST_NORM]), x, R, H, eps);
        const int64_t* gl = lin + LIN_GATE_UP * LIN_N;
        const float* mlp_in = gu;
        if (gl[LIN_FUSED]) {
            if ((rc = linear(gl, x, H, gu, I, R))) break;
        } else {
            if ((rc = linear(gl, x, H, gu, 2 * I, R))) break;
            silu_mul_f32(gu, act, R, I);
            mlp_in = act;
        }
        rc = linear(lin + LIN_DOWN * LIN_N, mlp_in, I, h, H, R);
    }
    if (!rc) add_rms_norm_f32(h, res, P(const float*, ptrs[P_NORM]), out, R, H, eps);
    free(mem);
    return rc;
}

/* The linears lins[0..n) (LIN_N entries each, as a layer's) called in turn on R rows of x
 * as a step calls them: a row with glu[i] set that does not apply silu(gate) * up itself
 * is followed by silu_mul_f32 into act, as in the step. x: R rows of the largest K; y: R
 * rows of the largest N; act: R rows of the largest N / 2. passes + 1 passes, the first
 * untimed; seconds[p * n + i]: call i's wall time in timed pass p. The start-up choice
 * times the kernels the step calls with it: no Python or ctypes between the calls. */
int decode_linears_time(const int64_t* lins, int n, const int32_t* glu, int R,
                        const float* x, float* y, float* act, int passes, double* seconds) {
    for (int p = 0; p <= passes; p++)
        for (int i = 0; i < n; i++) {
            const int64_t* lp = lins + (int64_t)i * LIN_N;
            const int N = (int)lp[LIN_N_OUT], K = (int)lp[LIN_K];
            const int fused = (int)lp[LIN_FUSED], width = fused ? N / 2 : N;
            struct timespec t0, t1;
            clock_gettime(CLOCK_MONOTONIC, &t0);
            const int rc = linear(lp, x, K, y, width, R);
            if (rc) return rc;
            if (glu[i] && !fused) silu_mul_f32(y, act, R, N / 2);
            clock_gettime(CLOCK_MONOTONIC, &t1);
            if (p)
                seconds[(int64_t)(p - 1) * n + i] =
                    (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        }
    return 0;
}
