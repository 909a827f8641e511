/*
 * The one-byte KV cache's write (model/quant/kv_cache.py's QuantizedKV): each token's
 * K or V heads quantized at its slot, in one call a layer instead of a dozen torch ops.
 * A head's scale is its absmax over the format's largest value (floored at 1e-12), each
 * element divided by it and rounded to nearest even: int8 clamped to +-127, e4m3fn
 * saturating at 448 (infinities too), e5m2 overflowing to infinity at 61440 and up, NaN
 * to the format's NaN: the bytes torch's own conversions write for the same floats.
 *
 *   x       [T, H, D] float32 or bfloat16 (uint16 bits), each row's heads contiguous,
 *           rows x_stride elements apart (the QKV projection's K or V columns)
 *   slots   [T] int64
 *   codes   [num_slots, H, D] one byte;  scales [num_slots, H] float32
 *
 * Built without -ffast-math and without contraction (kernels/cpu/__init__.py's
 * SOURCE_FLAGS): the divisions must be divisions, as torch's are.
 */
#include <math.h>
#include <stdint.h>

#include "kv_quant.h"

static inline uint8_t f32_to_int8(float y) {
    float r = nearbyintf(y);  /* ties to even (the default rounding mode) */
    r = r < -127.f ? -127.f : r > 127.f ? 127.f : r;
    return (uint8_t)(int8_t)r;
}

/* Round to nearest even into an fp8 format of mb mantissa bits and exponent bias `bias`
 * (its finite overflow and NaN handled by the caller). */
static inline uint32_t fp8_round(uint32_t mag_bits, const int mb, const int bias) {
    const uint32_t min_normal = (uint32_t)(127 + 1 - bias) << 23;
    if (mag_bits < min_normal)  /* subnormal codes: multiples of 2^(1 - bias - mb) */
        return (uint32_t)nearbyintf(kvq_bits_to_f32(mag_bits)
                                    * kvq_bits_to_f32((uint32_t)(127 + bias + mb - 1) << 23));
    const int shift = 23 - mb;  /* a carry out of the mantissa moves the exponent up */
    mag_bits += ((1u << (shift - 1)) - 1) + ((mag_bits >> shift) & 1u);
    return (mag_bits >> shift) - ((uint32_t)(127 - bias) << mb);
}

static inline uint8_t f32_to_code(float y, int kind) {
    if (kind == KV_INT8) return f32_to_int8(y);
    const uint32_t u = kvq_f32_bits(y), mag = u & 0x7fffffffu;
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    if (mag > 0x7f800000u) return sign | 0x7fu;  /* NaN */
    if (kind == KV_E4M3)
        return sign | (mag >= 0x43e00000u /* 448 */ ? 0x7eu : fp8_round(mag, 3, 7));
    return sign | (mag >= 0x47800000u /* 65536 */ ? 0x7cu : fp8_round(mag, 2, 15));
}

static inline float load_x(const void* x, int bf16, int64_t i) {
    return bf16 ? kvq_bits_to_f32((uint32_t)((const uint16_t*)x)[i] << 16)
                : ((const float*)x)[i];
}

void kv_store_q8(const void* x, int64_t x_stride, int x_bf16, const int64_t* slots, int T,
                 int H, int D, uint8_t* codes, float* scales, int kind) {
    const float qmax = kind == KV_INT8 ? 127.f : kind == KV_E4M3 ? 448.f : 57344.f;
    #pragma omp parallel for schedule(static) if (T >= 64)
    for (int t = 0; t < T; t++) {
        for (int h = 0; h < H; h++) {
            const int64_t src = (int64_t)t * x_stride + (int64_t)h * D;
            float amax = 0.f;
            for (int d = 0; d < D; d++) {
                const float a = fabsf(load_x(x, x_bf16, src + d));
                amax = a > amax ? a : amax;
            }
            float scale = amax / qmax;
            scale = scale < 1e-12f ? 1e-12f : scale;
            uint8_t* out = codes + (slots[t] * H + h) * (int64_t)D;
            for (int d = 0; d < D; d++) out[d] = f32_to_code(load_x(x, x_bf16, src + d) / scale,
                                                             kind);
            scales[slots[t] * H + h] = scale;
        }
    }
}
