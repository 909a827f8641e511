/*
 * simd_math.h's exp at one vector width, included once per width with VEC_EXP (its
 * name), VF, VI (the float and integer vectors), V(op) (the intrinsic op at that width:
 * V(_add_ps) is _mm256_add_ps or _mm512_add_ps), V_CAST_SI_PS and V_FLOOR defined; it
 * undefines them at its end, so the next width defines its own.
 *
 * e^x (Cephes' expf: a degree-5 polynomial on x - n ln 2, then 2^n through the exponent
 * bits); within ~1 ulp of expf, 0 below -88.37.
 */
static inline VF VEC_EXP(VF x) {
    x = V(_min_ps)(V(_max_ps)(x, V(_set1_ps)(-88.3762626647949f)),
                   V(_set1_ps)(88.3762626647949f));
    VF n = V_FLOOR(V(_fmadd_ps)(x, V(_set1_ps)(1.44269504088896341f), V(_set1_ps)(0.5f)));
    x = V(_fnmadd_ps)(n, V(_set1_ps)(0.693359375f), x);
    x = V(_fnmadd_ps)(n, V(_set1_ps)(-2.12194440e-4f), x);
    VF y = V(_set1_ps)(1.9875691500e-4f);
    y = V(_fmadd_ps)(y, x, V(_set1_ps)(1.3981999507e-3f));
    y = V(_fmadd_ps)(y, x, V(_set1_ps)(8.3334519073e-3f));
    y = V(_fmadd_ps)(y, x, V(_set1_ps)(4.1665795894e-2f));
    y = V(_fmadd_ps)(y, x, V(_set1_ps)(1.6666665459e-1f));
    y = V(_fmadd_ps)(y, x, V(_set1_ps)(5.0000001201e-1f));
    y = V(_fmadd_ps)(y, V(_mul_ps)(x, x), V(_add_ps)(x, V(_set1_ps)(1.f)));
    const VI e = V(_slli_epi32)(V(_add_epi32)(V(_cvttps_epi32)(n), V(_set1_epi32)(127)), 23);
    return V(_mul_ps)(y, V_CAST_SI_PS(e));
}

#undef VEC_EXP
#undef VF
#undef VI
#undef V
#undef V_CAST_SI_PS
#undef V_FLOOR
