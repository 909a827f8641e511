/*
 * The AMX tile instructions prefill_attention_amx.c uses, emulated in scalar C, for
 * builds with CONVEYOR_EMULATE_AMX (the "amx-emulated" cap of kernels/__init__.py): a CPU
 * with AVX-512 BF16 but no AMX (an AMD Zen 4 or 5) then runs the AMX body's own packing,
 * softmax and tile walk, so the tests check that body on machines that cannot run it for
 * real. Slow (a tile product is 8,192 scalar multiply-adds): for tests, never served.
 *
 * Semantics after Intel's SDM: eight tiles of up to 16 rows x 64 bytes, shaped by
 * _tile_loadconfig (palette 1); TDPBF16PS adds, for each row m and fp32 column n of C,
 * A's bf16 pairs times B's row k pairs, even element first, in fp32. (The hardware treats
 * bf16 denormals as zero and rounds each add to nearest even, ignoring MXCSR; the
 * emulation's fp32 adds round to nearest too, denormal inputs aside.)
 */
#ifndef CONVEYOR_AMX_EMULATION_H
#define CONVEYOR_AMX_EMULATION_H
#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t data[16][64];
    int rows, colsb;
} emu_tile;

static __thread emu_tile emu_tiles[8];

static inline void emu_tile_loadconfig(const void* config) {
    const uint8_t* c = (const uint8_t*)config; /* palette, start row, 14 reserved, ... */
    for (int t = 0; t < 8; t++) {
        uint16_t colsb;
        memcpy(&colsb, c + 16 + 2 * t, sizeof colsb);
        emu_tiles[t].colsb = colsb;
        emu_tiles[t].rows = c[48 + t];
    }
}

static inline void emu_tile_release(void) { memset(emu_tiles, 0, sizeof emu_tiles); }

static inline void emu_tile_zero(int t) { memset(emu_tiles[t].data, 0, sizeof emu_tiles[t].data); }

static inline void emu_tile_loadd(int t, const void* base, long stride) {
    for (int r = 0; r < emu_tiles[t].rows; r++)
        memcpy(emu_tiles[t].data[r], (const uint8_t*)base + r * stride, emu_tiles[t].colsb);
}

static inline void emu_tile_stored(int t, void* base, long stride) {
    for (int r = 0; r < emu_tiles[t].rows; r++)
        memcpy((uint8_t*)base + r * stride, emu_tiles[t].data[r], emu_tiles[t].colsb);
}

static inline float emu_bf16(const uint8_t* p) {
    uint16_t b;
    memcpy(&b, p, sizeof b);
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline void emu_tile_dpbf16ps(int dst, int a, int b) {
    emu_tile *c = &emu_tiles[dst], *ta = &emu_tiles[a], *tb = &emu_tiles[b];
    for (int m = 0; m < c->rows; m++)
        for (int n = 0; n < c->colsb / 4; n++) {
            float acc;
            memcpy(&acc, c->data[m] + 4 * n, sizeof acc);
            for (int k = 0; k < ta->colsb / 4; k++) {
                acc += emu_bf16(ta->data[m] + 4 * k) * emu_bf16(tb->data[k] + 4 * n);
                acc += emu_bf16(ta->data[m] + 4 * k + 2) * emu_bf16(tb->data[k] + 4 * n + 2);
            }
            memcpy(c->data[m] + 4 * n, &acc, sizeof acc);
        }
}

/* (immintrin.h may define these as macros, as inline assembly, even without AMX) */
#undef _tile_loadconfig
#undef _tile_release
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#define _tile_loadconfig(config) emu_tile_loadconfig(config)
#define _tile_release() emu_tile_release()
#define _tile_zero(t) emu_tile_zero(t)
#define _tile_loadd(t, base, stride) emu_tile_loadd(t, base, stride)
#define _tile_stored(t, base, stride) emu_tile_stored(t, base, stride)
#define _tile_dpbf16ps(dst, a, b) emu_tile_dpbf16ps(dst, a, b)

#endif
