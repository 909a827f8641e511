/*
 * A 16 x 16 block of 32-bit lanes transposed in registers (AVX-512F; include after
 * immintrin.h), shared by the prefill attention bodies that lay keys out as columns:
 * the AVX-512 body's K chunks and the AMX body's K tiles.
 */
#ifndef CONVEYOR_TRANSPOSE16_H
#define CONVEYOR_TRANSPOSE16_H
#include <stdint.h>

/* A chunk's keys as columns: dst[16 c + jj] = rows[jj][col0 + c] for 16 columns c of
 * 32-bit lanes (a float32 dim, or a bf16 pair of dims), the 16 x 16 block transposed in
 * registers. As a scalar loop it was ~5% of the kernel's time under perf on a Zen 4 (fp32),
 * and GCC built the bf16 pairs' from scatters (as it did the AMX body's K tiles). */
static inline void keys_to_columns(const void* const rows[16], int col0, uint32_t* dst) {
    __m512i r[16], t[16];
    for (int jj = 0; jj < 16; jj++)
        r[jj] = _mm512_loadu_si512((const uint32_t*)rows[jj] + col0);
    for (int i = 0; i < 8; i++) { /* per 128-bit lane: rows 2i, 2i + 1 */
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) { /* r[4i + e]: rows 4i..4i+3 of column 4L + e, lane L */
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int e = 0; e < 4; e++) { /* lane L of the four row groups, for L = 0..3 */
        const __m512i a = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x88);
        const __m512i b = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xDD);
        const __m512i x = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x88);
        const __m512i y = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xDD);
        _mm512_store_si512(dst + e * 16, _mm512_shuffle_i32x4(a, x, 0x88));
        _mm512_store_si512(dst + (8 + e) * 16, _mm512_shuffle_i32x4(a, x, 0xDD));
        _mm512_store_si512(dst + (4 + e) * 16, _mm512_shuffle_i32x4(b, y, 0x88));
        _mm512_store_si512(dst + (12 + e) * 16, _mm512_shuffle_i32x4(b, y, 0xDD));
    }
}
#endif
