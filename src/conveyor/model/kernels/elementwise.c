/*
 * Fused elementwise kernels for the decoder layer on CPU (float32).
 *
 * In eager PyTorch each of these is five to fifteen small ops, and at decode batch sizes
 * the per-op dispatch costs more than the arithmetic. Each function here is one pass
 * over its rows, parallel over rows with OpenMP, vectorized by the compiler.
 */
#include <math.h>
#include <stdint.h>

#include "bf16.h"

/* out = rms_norm(x) * w  (rows of dim) */
void rms_norm_f32(const float* x, const float* w, float* out, int rows, int dim, float eps) {
    #pragma omp parallel for schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        const float* xr = x + (int64_t)r * dim;
        float* o = out + (int64_t)r * dim;
        float ss = 0.f;
        for (int i = 0; i < dim; i++) ss += xr[i] * xr[i];
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
        for (int i = 0; i < dim; i++) o[i] = w[i] * (xr[i] * inv);
    }
}

/* residual += x; out = rms_norm(residual) * w  (the pre-norm residual stream) */
void add_rms_norm_f32(const float* x, float* residual, const float* w, float* out, int rows,
                      int dim, float eps) {
    #pragma omp parallel for schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        const float* xr = x + (int64_t)r * dim;
        float* res = residual + (int64_t)r * dim;
        float* o = out + (int64_t)r * dim;
        float ss = 0.f;
        for (int i = 0; i < dim; i++) {
            const float h = res[i] + xr[i];
            res[i] = h;
            ss += h * h;
        }
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
        for (int i = 0; i < dim; i++) o[i] = w[i] * (res[i] * inv);
    }
}

/* out[r, i] = silu(gu[r, i]) * gu[r, inter + i] */
void silu_mul_f32(const float* gu, float* out, int rows, int inter) {
    #pragma omp parallel for schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        const float* g = gu + (int64_t)r * 2 * inter;
        const float* u = g + inter;
        float* o = out + (int64_t)r * inter;
        /* the clamp keeps expf finite, as -ffast-math assumes: silu(g < -80) ~ 0 */
        for (int i = 0; i < inter; i++) o[i] = g[i] / (1.f + expf(fminf(-g[i], 80.f))) * u[i];
    }
}

/*
 * Neox-style rotary embedding, in place on the first (Hq + Hkv) heads of each row of a
 * packed [T, (Hq + 2 Hkv) * D] QKV buffer. cos/sin: [max_pos, D] tables (halves equal).
 */
void rope_f32(float* qkv, const int64_t* pos, const float* cos_t, const float* sin_t, int T,
              int heads, int row_stride, int D) {
    const int half = D / 2;
    #pragma omp parallel for schedule(static) if (T > 8)
    for (int t = 0; t < T; t++) {
        const float* c = cos_t + pos[t] * D;
        const float* s = sin_t + pos[t] * D;
        for (int h = 0; h < heads; h++) {
            float* x = qkv + (int64_t)t * row_stride + (int64_t)h * D;
            for (int i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] - x2 * s[i];
                x[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
    }
}

/*
 * bfloat16 versions: bf16 in and out, fp32 arithmetic inside, rounded (to nearest even)
 * wherever the reference (TorchOps on bf16 tensors) rounds, so that they track it to
 * the rounding of a sum's order: RMSNorm rounds x / rms(x) before the weight multiplies,
 * the residual add rounds, silu rounds before the multiply by up, RoPE rounds the tables
 * and each product before the add. The conversions are shifts and integer adds, which
 * the compiler vectorizes for the machine's ISA (-march=native: AVX-512, AVX2 or scalar;
 * bf16.h).
 */
void rms_norm_bf16(const uint16_t* x, const uint16_t* w, uint16_t* out, int rows, int dim,
                   float eps) {
    #pragma omp parallel for schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        const uint16_t* xr = x + (int64_t)r * dim;
        uint16_t* o = out + (int64_t)r * dim;
        float ss = 0.f;
        for (int i = 0; i < dim; i++) {
            const float v = bf16_to_f32(xr[i]);
            ss += v * v;
        }
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
        for (int i = 0; i < dim; i++)
            o[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(xr[i]) * inv));
    }
}

void add_rms_norm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* w,
                       uint16_t* out, int rows, int dim, float eps) {
    #pragma omp parallel for schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        const uint16_t* xr = x + (int64_t)r * dim;
        uint16_t* res = residual + (int64_t)r * dim;
        uint16_t* o = out + (int64_t)r * dim;
        float ss = 0.f;
        for (int i = 0; i < dim; i++) {
            const uint16_t hb = f32_to_bf16(bf16_to_f32(res[i]) + bf16_to_f32(xr[i]));
            const float h = bf16_to_f32(hb);
            res[i] = hb;
            ss += h * h;
        }
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
        for (int i = 0; i < dim; i++)
            o[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(res[i]) * inv));
    }
}

void silu_mul_bf16(const uint16_t* gu, uint16_t* out, int rows, int inter) {
    #pragma omp parallel for schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        const uint16_t* g = gu + (int64_t)r * 2 * inter;
        const uint16_t* u = g + inter;
        uint16_t* o = out + (int64_t)r * inter;
        for (int i = 0; i < inter; i++) {
            const float gv = bf16_to_f32(g[i]);
            const float s = round_bf16(gv / (1.f + expf(fminf(-gv, 80.f))));
            o[i] = f32_to_bf16(s * bf16_to_f32(u[i]));
        }
    }
}

void rope_bf16(uint16_t* qkv, const int64_t* pos, const float* cos_t, const float* sin_t,
               int T, int heads, int row_stride, int D) {
    const int half = D / 2;
    #pragma omp parallel for schedule(static) if (T > 8)
    for (int t = 0; t < T; t++) {
        const float* c = cos_t + pos[t] * D;
        const float* s = sin_t + pos[t] * D;
        for (int h = 0; h < heads; h++) {
            uint16_t* x = qkv + (int64_t)t * row_stride + (int64_t)h * D;
            for (int i = 0; i < half; i++) {
                const float x1 = bf16_to_f32(x[i]), x2 = bf16_to_f32(x[i + half]);
                const float c1 = round_bf16(c[i]), s1 = round_bf16(s[i]);
                const float c2 = round_bf16(c[i + half]), s2 = round_bf16(s[i + half]);
                x[i] = f32_to_bf16(round_bf16(x1 * c1) + round_bf16(-x2 * s1));
                x[i + half] = f32_to_bf16(round_bf16(x2 * c2) + round_bf16(x1 * s2));
            }
        }
    }
}
