/*
 * Vector math shared by the SIMD kernels (include after immintrin.h): exp256 under
 * AVX2 + FMA, exp512 under AVX-512F, both from one definition (simd_exp.h).
 */
#ifndef CONVEYOR_SIMD_MATH_H
#define CONVEYOR_SIMD_MATH_H

/* Two-step paste, so that a macro argument (an intrinsics prefix) expands first. */
#define CONVEYOR_CAT_(a, b) a##b
#define CONVEYOR_CAT(a, b) CONVEYOR_CAT_(a, b)

#if defined(__AVX2__) && defined(__FMA__)
#define VEC_EXP exp256
#define VF __m256
#define VI __m256i
#define V(op) CONVEYOR_CAT(_mm256, op)
#define V_CAST_SI_PS _mm256_castsi256_ps
#define V_FLOOR _mm256_floor_ps
#include "simd_exp.h" /* (it undefines its parameters) */
#endif

#if defined(__AVX512F__)
#define VEC_EXP exp512
#define VF __m512
#define VI __m512i
#define V(op) CONVEYOR_CAT(_mm512, op)
#define V_CAST_SI_PS _mm512_castsi512_ps
#define V_FLOOR(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#include "simd_exp.h" /* (it undefines its parameters) */
#endif

#endif
