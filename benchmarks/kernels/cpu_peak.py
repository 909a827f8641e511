"""This CPU's arithmetic peak per core, to set a GEMM's speed against: independent chains
of one vector instruction (float32 FMAs on the widest vectors the CPU has, and bf16 dot
products, ``vdpbf16ps``, where it has AVX-512 BF16), enough of them to hide the latency,
on one thread. A GEMM on N cores is at most N times this (AMX tiles, where present, are
not measured here).

    python -m benchmarks.kernels.cpu_peak
"""

from __future__ import annotations

import os
import subprocess
import tempfile

from conveyor.kernels import cpu as kernels
from conveyor.kernels.cpu.cpuinfo import cpu_flags, cpu_model_name

SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9;
}
#define CHAINS 12
/* float32 FMAs on the widest vectors the CPU has: the same loop at either width */
#if defined(__AVX512F__)
#define BITS 512
typedef __m512 vf;
#define SET1 _mm512_set1_ps
#define FMADD _mm512_fmadd_ps
static float vsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define BITS 256
typedef __m256 vf;
#define SET1 _mm256_set1_ps
#define FMADD _mm256_fmadd_ps
static float vsum(vf v) {
    float o[8], s = 0;
    _mm256_storeu_ps(o, v);
    for (int k = 0; k < 8; k++) s += o[k];
    return s;
}
#endif
int main(void) {
    const long n = 100000000;
    double t, dt;
    float s;
#ifdef BITS
    vf f[CHAINS], x = SET1(1.0001f);
    for (int j = 0; j < CHAINS; j++) f[j] = SET1((float)j);
    t = now();
    for (long i = 0; i < n; i++) {
        for (int j = 0; j < CHAINS; j++) f[j] = FMADD(f[j], x, x);
        __asm__ volatile("" : "+v"(x));
    }
    dt = now() - t;
    s = 0; for (int j = 0; j < CHAINS; j++) s += vsum(f[j]);
    printf("float32 FMA, %d-bit: %.1f GFLOP/s (%g)\n", BITS, n * CHAINS * (BITS / 16.0) / dt / 1e9,
           s);
#endif
#if defined(__AVX512BF16__)
    __m512 a[CHAINS];
    __m512bh b = (__m512bh)_mm512_set1_epi16(0x3f80), c = b;
    for (int j = 0; j < CHAINS; j++) a[j] = _mm512_set1_ps((float)j);
    t = now();
    for (long i = 0; i < n; i++) {
        for (int j = 0; j < CHAINS; j++) a[j] = _mm512_dpbf16_ps(a[j], b, c);
        __asm__ volatile("" : "+v"(b));
    }
    dt = now() - t;
    s = 0; for (int j = 0; j < CHAINS; j++) s += _mm512_reduce_add_ps(a[j]);
    printf("bf16 dot products (vdpbf16ps), 512-bit: %.1f GFLOP/s (%g)\n",
           n * CHAINS * 64.0 / dt / 1e9, s);
#endif
    return 0;
}
"""


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "peak.c"), os.path.join(d, "peak")
        with open(src, "w") as f:
            f.write(SOURCE)
        subprocess.run([kernels.find_compiler() or "cc", "-O2", "-march=native",
                        "-funroll-loops", src, "-o", exe], check=True)
        flags = cpu_flags() or frozenset()
        print(f"CPU: {cpu_model_name()}; one thread, the peak of one core"
              + ("; AMX tiles present, not measured" if "amx_tile" in flags else ""))
        print(subprocess.run([exe], check=True, capture_output=True, text=True).stdout, end="")


if __name__ == "__main__":
    main()
