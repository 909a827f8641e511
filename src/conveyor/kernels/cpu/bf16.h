/*
 * bfloat16 <-> float32, shared by the kernels that take bf16 tensors. The conversions
 * are shifts and integer adds, which the compiler vectorizes for the machine's ISA.
 * f32_to_bf16 rounds to nearest even, as torch's .to(torch.bfloat16) does for finite values.
 */
#ifndef CONVEYOR_BF16_H
#define CONVEYOR_BF16_H
#include <stdint.h>

static inline float bf16_to_f32(uint16_t b) {
    union { uint32_t u; float f; } v = { (uint32_t)b << 16 };
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } v = { f };
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#endif
