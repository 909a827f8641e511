"""This CPU's arithmetic peak per core, to set a GEMM's speed against: independent chains
of one vector instruction (float32 FMAs on the widest vectors the CPU has, and bf16 dot
products, ``vdpbf16ps``, where it has AVX-512 BF16), enough of them to hide the latency,
on one thread. A GEMM on N cores is at most N times this (AMX tiles, where present, are
not measured here).

    python benchmarks/cpu_peak.py
"""

from __future__ import annotations

import os
import subprocess
import tempfile

from conveyor.model.dtypes import cpu_flags, cpu_model_name

SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9;
}
#define CHAINS 12
int main(void) {
    const long n = 100000000;
#if defined(__AVX512F__)
    __m512 f[CHAINS], x = _mm512_set1_ps(1.0001f);
    for (int j = 0; j < CHAINS; j++) f[j] = _mm512_set1_ps((float)j);
    double t = now();
    for (long i = 0; i < n; i++) {
        for (int j = 0; j < CHAINS; j++) f[j] = _mm512_fmadd_ps(f[j], x, x);
        __asm__ volatile("" : "+v"(x));
    }
    double dt = now() - t;
    float s = 0; for (int j = 0; j < CHAINS; j++) s += _mm512_reduce_add_ps(f[j]);
    printf("float32 FMA, 512-bit: %.1f GFLOP/s (%g)\n", n * CHAINS * 32.0 / dt / 1e9, s);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 f[CHAINS], x = _mm256_set1_ps(1.0001f);
    for (int j = 0; j < CHAINS; j++) f[j] = _mm256_set1_ps((float)j);
    double t = now();
    for (long i = 0; i < n; i++) {
        for (int j = 0; j < CHAINS; j++) f[j] = _mm256_fmadd_ps(f[j], x, x);
        __asm__ volatile("" : "+v"(x));
    }
    double dt = now() - t;
    float s = 0, o[8];
    for (int j = 0; j < CHAINS; j++) {
        _mm256_storeu_ps(o, f[j]);
        for (int k = 0; k < 8; k++) s += o[k];
    }
    printf("float32 FMA, 256-bit: %.1f GFLOP/s (%g)\n", n * CHAINS * 16.0 / dt / 1e9, s);
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
        cc = os.environ.get("CC") or "cc"
        subprocess.run([cc, "-O2", "-march=native", "-funroll-loops", src, "-o", exe],
                       check=True)
        flags = cpu_flags() or frozenset()
        print(f"CPU: {cpu_model_name()}; one thread, the peak of one core"
              + ("; AMX tiles present, not measured" if "amx_tile" in flags else ""))
        print(subprocess.run([exe], check=True, capture_output=True, text=True).stdout, end="")


if __name__ == "__main__":
    main()
