"""The quantized GEMM (``quant_gemm.c``) at decode row counts against the native GEMM on
bf16 weights (float32 arithmetic, what a bf16 checkpoint runs on a CPU without bf16
arithmetic), in one process, with the bytes each streams.

As in ``gemm_rows``, every call reads its weight from memory: the calls run over every
projection of ``--layers`` layers of a model's shapes, in layer order; a pass's time is
reported (ms, the fastest of ``--passes`` in any of ``--rounds``, kinds in alternation
each round: on a shared machine the fastest pass is the one least hit by others' load),
and GB/s = the weight bytes a pass reads / its time.

    python -m benchmarks.kernels.quant_rows --rows 1,8,32 --rounds 3
    python -m benchmarks.kernels.quant_rows --rows 1 --against HEAD~1 --stream

``int4 a16``: the int4 weights through ``qgemm_a16`` (x rounded to int16 per row, integer
sums); ``a16/int4``: how much faster than the float path. ``int8 a16``: the int8 weights
through ``qgemm_a16_i8`` (the same, int32 sums in 512-column blocks); ``a16/int8``: how
much faster than int8's float path, ``i8a16/bf16``: than the bf16 weights.

``--against REV``: REV's ``quant_gemm.c`` (same weight layout) built beside this tree's
and timed in the same rounds (``int8@REV``, ``int4@REV``). ``--stream``: a plain
streaming read of the int8 kinds' bytes (torch's float32 sum over one buffer of that
size, on the same threads), the bandwidth a weight-bound GEMV could reach.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

from conveyor.kernels.cpu import ops
from conveyor.kernels.cpu import quant as qkernel
from conveyor.kernels.cpu.cpuinfo import cpu_model_name
from conveyor.model.quant.apply import int4_group
from conveyor.model.quant.linear import NativeA16Linear, NativeQuantLinear
from conveyor.model.quant.weight import quantize_int4, quantize_int8

# (N, K) of one layer's projections as conveyor packs them: QKV, O, gate/up, down
SHAPES = {"smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
          "qwen3-0.6b": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]}


def weight_bytes(kind: str, n: int, k: int) -> int:
    if kind.startswith("bf16"):
        return 2 * n * k
    if kind.startswith("int8"):
        return n * k + 4 * n
    return n * k // 2 + 8 * n * (k // int4_group(k))


class StreamRead:
    """A pass that reads ``nbytes`` of float32 once (``sum``): the memory-bound floor."""

    in_features = 0

    def __init__(self, nbytes: int) -> None:
        self.buf = torch.ones(nbytes // 4)

    def __call__(self, x) -> None:
        self.buf.sum()


def source_at(rev: str) -> str:
    """``quant_gemm.c`` as of git revision ``rev``, in a temporary file."""
    text = subprocess.run(["git", "show", f"{rev}:src/conveyor/kernels/cpu/quant_gemm.c"],
                          check=True, capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), "quant_gemm.c")
    with open(path, "w") as f:
        f.write(text)
    return path


def build(kind: str, shapes, layers: int, gen: torch.Generator, lib=None) -> list:
    if kind == "stream":
        return [StreamRead(layers * sum(weight_bytes("int8", n, k) for n, k in shapes))]
    calls = []
    for _ in range(layers):
        for n, k in shapes:
            w = torch.randn(n, k, generator=gen) * 0.02
            if kind.startswith("bf16"):
                calls.append(ops.PackedGemm(w.to(torch.bfloat16).contiguous(), None))
            elif kind.startswith("int8 a16"):
                calls.append(NativeA16Linear(quantize_int8(w), None, lib))
            elif kind.startswith("int8"):
                calls.append(NativeQuantLinear(quantize_int8(w), None, lib))
            elif kind.startswith("int4 a16"):
                calls.append(NativeA16Linear(quantize_int4(w, int4_group(k)), None, lib))
            else:
                calls.append(NativeQuantLinear(quantize_int4(w, int4_group(k)), None, lib))
    return calls


def one_pass(calls: list, xs: dict[int, torch.Tensor], clock=time.perf_counter) -> float:
    t = clock()
    for fn in calls:
        fn(xs[fn.in_features])
    return clock() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--against", default=None, metavar="REV",
                   help="also time REV's quant_gemm.c (int8@REV, int4@REV)")
    p.add_argument("--stream", action="store_true",
                   help="also time a plain streaming read of the int8 bytes")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: the process's CPU time (with --threads 1: a kernel's own "
                   "time, steadier than wall time where others load the machine)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not ops.gemm_available() or not qkernel.simd():
        print("the native kernels are not built with AVX2 + FMA on this CPU")
        return 1
    if args.clock == "cpu" and args.threads != 1:
        print("--clock cpu counts every thread's time (spinning ones too): use --threads 1")
        return 1
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    shapes = SHAPES[args.model]
    kinds = ["bf16 native", "int8", "int8 a16", "int4", "int4 a16"]
    libs: dict[str, object] = {}
    if args.against:
        old = qkernel.build(source_at(args.against))
        for kd in ("int8", "int4"):
            kinds.append(f"{kd}@{args.against}")
            libs[kinds[-1]] = old
    if args.stream:
        kinds.append("stream")
    total = {kd: args.layers * sum(weight_bytes("int8" if kd == "stream" else kd, n, k)
                                   for n, k in shapes) for kd in kinds}
    gen = torch.Generator().manual_seed(0)
    print(f"CPU: {cpu_model_name()}, {args.threads} threads; {args.layers} layers of "
          f"{args.model}'s projection shapes; {args.clock} ms per pass (GB/s of weights)")
    width = max(18, *(len(k) for k in kinds))
    print(f"{'rows':>5} " + " ".join(f"{k:>{width}}" for k in kinds)
          + "   int8/bf16 int4/bf16 a16/int4 a16/int8 i8a16/bf16" + (
              f"  int8/int8@{args.against} int4/int4@{args.against}" if args.against else ""))
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen) for _, k in shapes}
        xs[0] = None  # (the streaming read takes no x)
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(args.rounds):
            for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
                calls = build(kind, shapes, args.layers, gen, libs.get(kind))
                one_pass(calls, xs)  # untimed: first touches
                times[kind].append(min(one_pass(calls, xs, clock) for _ in range(args.passes)))
                del calls
        med = {k: min(v) for k, v in times.items()}
        cells = [f"{med[k] * 1e3:.2f} ({total[k] / med[k] / 1e9:.1f})" for k in kinds]
        line = (f"{rows:>5} " + " ".join(f"{c:>{width}}" for c in cells)
                + f"   {med['bf16 native'] / med['int8']:.2f}x"
                + f"     {med['bf16 native'] / med['int4']:.2f}x"
                + f"     {med['int4'] / med['int4 a16']:.2f}x"
                + f"     {med['int8'] / med['int8 a16']:.2f}x"
                + f"     {med['bf16 native'] / med['int8 a16']:.2f}x")
        if args.against:
            line += (f"  {med[f'int8@{args.against}'] / med['int8']:.2f}x"
                     f"     {med[f'int4@{args.against}'] / med['int4']:.2f}x")
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
