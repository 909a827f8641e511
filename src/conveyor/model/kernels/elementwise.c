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

/* silu by vector exp where the CPU has AVX-512F or AVX2 + FMA (16 or 8 lanes): libmvec's
 * expf through the compiler runs at ~1/3 of memory speed on the MLP's 2,048 x 1,536
 * (benchmarks/prefill_step.py); exp512/exp256 are Cephes' polynomial, within ~1 ulp. */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

#include "simd_math.h"
#endif

#if defined(__AVX512F__)
#define SILU_LANES 16
typedef __m512 vf_t;
/* 1 / d by rcp14 and one Newton step (~2^-28 relative, about an ulp): a vdivps is ~3x the
 * rest of silu on a Zen 5 */
static inline vf_t recip_v(vf_t d) {
    const vf_t r = _mm512_rcp14_ps(d);
    return _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
}
/* g / (1 + e^-g), -g clamped at 80 as the scalar loop does */
static inline vf_t silu_v(vf_t g) {
    const vf_t e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), g),
                                        _mm512_set1_ps(80.f)));
    return _mm512_mul_ps(g, recip_v(_mm512_add_ps(_mm512_set1_ps(1.f), e)));
}
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, x) _mm512_storeu_ps(p, x)
#define VMUL(a, b) _mm512_mul_ps(a, b)
/* bf16.h's conversions, 16 lanes: widen by a shift, round to nearest even by integer adds */
static inline vf_t vload_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline __m512i rne_bits(vf_t f) { /* the rounded value's top 16 bits, as int32 */
    const __m512i u = _mm512_castps_si512(f);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                              odd), 16);
}
#if defined(__AVX512BF16__)
/* vcvtneps2bf16 rounds to nearest even too (it differs from the integer adds on NaN only) */
static inline __m256i bf16_bits(vf_t f) { return (__m256i)_mm512_cvtneps_pbh(f); }
#else
static inline __m256i bf16_bits(vf_t f) { return _mm512_cvtepi32_epi16(rne_bits(f)); }
#endif
static inline vf_t vround_bf16(vf_t f) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(f)), 16));
}
static inline void vstore_bf16(uint16_t* p, vf_t f) {
    _mm256_storeu_si256((__m256i*)p, bf16_bits(f));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define SILU_LANES 8
typedef __m256 vf_t;
/* rcp (12 bits) and one Newton step: ~2^-22 relative, one or two ulps */
static inline vf_t recip_v(vf_t d) {
    const vf_t r = _mm256_rcp_ps(d);
    return _mm256_mul_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(2.f)));
}
static inline vf_t silu_v(vf_t g) {
    const vf_t e = exp256(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g),
                                        _mm256_set1_ps(80.f)));
    return _mm256_mul_ps(g, recip_v(_mm256_add_ps(_mm256_set1_ps(1.f), e)));
}
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, x) _mm256_storeu_ps(p, x)
#define VMUL(a, b) _mm256_mul_ps(a, b)
static inline vf_t vload_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline __m256i rne_bits(vf_t f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)),
                                              odd), 16);
}
static inline vf_t vround_bf16(vf_t f) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(rne_bits(f), 16));
}
static inline void vstore_bf16(uint16_t* p, vf_t f) {
    const __m256i b = rne_bits(f); /* each lane < 2^16: packus keeps it */
    _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(b),
                                                   _mm256_extracti128_si256(b, 1)));
}
#else
#define SILU_LANES 0
#endif

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
        int i = 0;
#if SILU_LANES
        for (; i + SILU_LANES <= inter; i += SILU_LANES)
            VSTORE(o + i, VMUL(silu_v(VLOAD(g + i)), VLOAD(u + i)));
#endif
        /* the clamp keeps expf finite, as -ffast-math assumes: silu(g < -80) ~ 0 */
        for (; i < inter; i++) o[i] = g[i] / (1.f + expf(fminf(-g[i], 80.f))) * u[i];
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
        int i = 0;
#if SILU_LANES
        for (; i + SILU_LANES <= inter; i += SILU_LANES)
            vstore_bf16(o + i, VMUL(vround_bf16(silu_v(vload_bf16(g + i))),
                                    vload_bf16(u + i)));
#endif
        for (; i < inter; i++) {
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
