"""The AMX prefill body's AVX-512 parts alone (``kernels/prefill_attention_amx.c``), this
tree's against git revision REV's, in alternation, on one thread (best of the rounds):
``pack_block`` (one prompt's K and V of 9/3 heads x 64 into B tiles, microseconds a
prompt) and ``softmax_block`` (a 16-row task's blocks of 32 keys at the prompt's last
row, microseconds a block), and whether the two produce the same bytes. Neither uses
the tiles, so they run on any CPU with AVX-512 BF16; without AMX the file is built with
``CONVEYOR_EMULATE_AMX``.

    python -m benchmarks.experiments.amx_body_parts --against HEAD~1
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile

from benchmarks.common import extract_at
from conveyor.kernels import cpu as kernels
from conveyor.kernels.cpu.cpuinfo import cpu_flags, cpu_model_name

HARNESS = r"""
#include SOURCE
#include <stdio.h>
#include <time.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
int main(int argc, char** argv) {
    const int L = atoi(argv[1]), reps = atoi(argv[2]), Hq = 9, Hkv = 3, D = 64;
    const int kv_stride = (Hq + 2 * Hkv) * D, nkb = (L + 31) / 32;
    const size_t block = (size_t)32 * D / 2, n = block * Hkv * nkb;
    uint16_t* qkv = malloc(sizeof(uint16_t) * (size_t)L * kv_stride);
    for (long i = 0; i < (long)L * kv_stride; i++) qkv[i] = (uint16_t)(i * 2654435761u >> 7);
    uint32_t* kb = aligned_alloc(64, 4 * n);
    uint32_t* vb = aligned_alloc(64, 4 * n);
    double best = 1e9;
    for (int r = 0; r < reps; r++) {
        const double t = now();
        for (int c = 0; c < Hkv * nkb; c++)
            pack_block(qkv + Hq * D, qkv + (Hq + Hkv) * D, kb + c * block, vb + c * block,
                       (c % nkb) * 32, L, c / nkb, D, kv_stride);
        if (now() - t < best) best = now() - t;
    }
    unsigned long long sum = 0;
    for (size_t i = 0; i < n; i++) sum = sum * 1000003u + kb[i] + 7u * vb[i];
    /* softmax_block over a 16-row task's blocks at row L (scores growing along the keys,
     * so some reference maxima move), the time of a block */
    task_buffers* b = aligned_alloc(64, sizeof(task_buffers));
    const int r0 = L / 16 * 16, nblocks = r0 / 32 + 1;
    float alpha[16];
    double best_sm = 1e9;
    for (int r = 0; r < reps; r++) {
        for (int i = 0; i < 16; i++) { b->m[i] = NEG; b->lv[i] = _mm512_setzero_ps(); }
        const double t = now();
        for (int blk = 0; blk < nblocks; blk++) {
            for (int i = 0; i < 16; i++)
                for (int c = 0; c < 32; c++)
                    b->s[i][c] = (float)((i * 37 + c * 11 + blk * 5) % 64) * 0.25f + 0.02f * blk;
            softmax_block(b, r0, blk * 32, 0.125f, alpha);
        }
        if ((now() - t) / nblocks < best_sm) best_sm = (now() - t) / nblocks;
    }
    for (int i = 0; i < 16; i++)
        for (int c = 0; c < 32; c++) sum = sum * 31u + b->p[i][c];
    printf("%.3f %.4f %llx\n", best * 1e6, best_sm * 1e6, sum);
    return 0;
}
"""


def build(source_dir: str, out_dir: str) -> str:
    """The harness around ``source_dir``'s prefill_attention_amx.c, built for this CPU."""
    src = os.path.join(out_dir, "harness.c")
    with open(src, "w") as f:
        f.write(HARNESS.replace("SOURCE", f'"{source_dir}/prefill_attention_amx.c"'))
    emulate = [] if "amx_bf16" in (cpu_flags() or ()) else ["-DCONVEYOR_EMULATE_AMX"]
    exe = os.path.join(out_dir, "harness")
    subprocess.run([kernels.find_compiler() or "cc", *kernels._FLAGS, *emulate, src, "-o", exe,
                    "-lm"], check=True)
    return exe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", metavar="REV", required=True)
    p.add_argument("--tokens", default="33,146,1024,2048")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if "avx512_bf16" not in (cpu_flags() or ()):
        raise SystemExit("the AMX body's packing needs AVX-512 BF16")
    here = os.path.dirname(os.path.abspath(kernels.__file__))
    with tempfile.TemporaryDirectory() as tmp:
        rev_dir = extract_at(args.against, tmp)
        os.makedirs(os.path.join(tmp, "tree"))
        os.makedirs(os.path.join(tmp, "rev"))
        exes = {"this tree": build(here, os.path.join(tmp, "tree")),
                args.against: build(rev_dir, os.path.join(tmp, "rev"))}
        print(f"CPU: {cpu_model_name()}; the AMX body's parts, 9/3 heads x 64, "
              f"1 thread, best of {args.rounds} rounds")
        for tokens in (int(t) for t in args.tokens.split(",")):
            best, sums = {}, {}
            for _ in range(args.rounds):
                for name, exe in exes.items():
                    out = subprocess.run([exe, str(tokens), "20"], check=True,
                                         capture_output=True, text=True).stdout.split()
                    pack, soft = best.get(name, (1e9, 1e9))
                    best[name] = (min(pack, float(out[0])), min(soft, float(out[1])))
                    sums[name] = out[2]
            (mine, mine_sm), (theirs, theirs_sm) = best["this tree"], best[args.against]
            same = "same bytes" if len(set(sums.values())) == 1 else "different bytes"
            print(f"{tokens:5d} tokens: pack_block this tree {mine:7.1f} us, {args.against} "
                  f"{theirs:7.1f} us ({theirs / mine:.2f}x); softmax_block a block "
                  f"{mine_sm:6.3f} us against {theirs_sm:6.3f} ({theirs_sm / mine_sm:.2f}x); "
                  f"{same}")


if __name__ == "__main__":
    main()
