/*
 * The one-byte KV cache's codes as floats (model/quant/kv_cache.py writes them: a code
 * times its token's per-head scale is the value). Kinds: KV_INT8 (a signed byte),
 * KV_E4M3 (float8 e4m3fn: bias 7, no infinities, S.1111.111 is NaN) and KV_E5M2 (float8
 * e5m2: bias 15, IEEE infinities and NaNs).
 *
 * fp8 by bit manipulation, exact for all 256 codes: the code's exponent and mantissa
 * bits go under fp32's, with the bias moved; a subnormal code (exponent 0) then reads
 * 2^-bias (1 + m 2^-mb) and its value m 2^(1 - bias - mb) is twice that less 2^-bias,
 * all normal floats, so flush-to-zero or denormals-are-zero never change a value. The
 * vector body in decode_attention.c runs the same steps on VW codes at once.
 */
#ifndef CONVEYOR_KV_QUANT_H
#define CONVEYOR_KV_QUANT_H
#include <stdint.h>

enum { KV_INT8 = 0, KV_E4M3 = 1, KV_E5M2 = 2 };

static inline float kvq_bits_to_f32(uint32_t u) {
    union { uint32_t u; float f; } v = { u };
    return v.f;
}

static inline uint32_t kvq_f32_bits(float f) {
    union { float f; uint32_t u; } v = { f };
    return v.u;
}

/* An fp8 code with mb mantissa bits and exponent bias `bias` as a float. */
static inline float fp8_to_f32(uint8_t code, const int mb, const int bias) {
    const uint32_t mag = code & 0x7fu;
    const float f = kvq_bits_to_f32((mag << (23 - mb)) + ((uint32_t)(127 - bias) << 23));
    uint32_t bits = (mag >> mb) == 0
        ? kvq_f32_bits((f - kvq_bits_to_f32((uint32_t)(127 - bias) << 23)) * 2.f)
        : kvq_f32_bits(f);
    if (mb == 3 && mag == 0x7fu) bits = 0x7fc00000u;  /* e4m3fn's NaN */
    if (mb == 2 && mag >= 0x7cu) bits = 0x7f800000u | ((mag & 3u) << 21);  /* inf, NaN */
    return kvq_bits_to_f32(bits | ((uint32_t)(code & 0x80u) << 24));
}

static inline float kvq_to_f32(uint8_t code, int kind) {
    if (kind == KV_INT8) return (float)(int8_t)code;
    return kind == KV_E4M3 ? fp8_to_f32(code, 3, 7) : fp8_to_f32(code, 2, 15);
}

#endif
