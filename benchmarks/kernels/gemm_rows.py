"""The native GEMM at decode row counts, float32 weights against bf16 weights (float32
arithmetic on their exact values), with oneDNN's packed GEMM beside them, in one process.

Each call reads its weight from memory, as in a decode step: the calls run over a copy of
every projection of ``--layers`` layers of a model's shapes (SmolLM2-135M's by default:
30 x 35 MB of float32 weights), in layer order, and a pass's time is what is reported
(ms per pass, the fastest of ``--passes``, backends in alternation each round, the median
over rounds). The last rows are a prefill-sized call on one weight (compute-bound: what
widening bf16 panels costs there).

    python -m benchmarks.kernels.gemm_rows --rows 1,2,4,8,32 --rounds 3

``--against REV`` adds both native columns with git revision REV's ``gemm.c`` (built with
this tree's flags, in the same alternation): a kernel change's before and after in one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from conveyor.kernels.cpu import ops
from conveyor.kernels.cpu.cpuinfo import cpu_model_name
from conveyor.model.linear.onednn import PackedLinear, onednn_available

SMOLLM2 = [(960, 576, False), (576, 576, False), (3072, 576, True), (576, 1536, False)]


def build(kind: str, layers: int, gen: torch.Generator) -> list:
    calls = []
    kind = kind.split(" @ ")[0]  # REV's kernel runs on the same packed weights
    for _ in range(layers):
        for n, k, gate_up in SMOLLM2:
            w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
            if kind == "native fp32":
                calls.append(ops.PackedGemm(w.float().contiguous(), None, gate_up))
            elif kind == "native bf16 weights":
                calls.append(ops.PackedGemm(w.contiguous(), None, gate_up))
            else:
                calls.append(PackedLinear(w.float(), None))
    return calls


def one_pass(calls: list, xs: dict[int, torch.Tensor], lib=None) -> float:
    """A pass over calls; with lib, through that library (ops' own restored after)."""
    own = ops._lib
    if lib is not None:
        ops._lib = lib
    try:
        t = time.perf_counter()
        for fn in calls:
            fn(xs[fn.in_features])
        return time.perf_counter() - t
    finally:
        ops._lib = own


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,2,4,8,32")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--prefill-rows", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--against", metavar="REV", help="also time git revision REV's gemm.c")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not ops.gemm_available():
        print("the native GEMM is not built on this CPU (no AVX2 + FMA)")
        return 1
    kinds = ["native fp32", "native bf16 weights"] + (["onednn fp32"] if onednn_available()
                                                      else [])
    libs = {}
    if args.against:
        from benchmarks.common import gemm_at

        other = gemm_at(args.against)
        for kind in kinds[:2]:
            libs[f"{kind} @ {args.against}"] = other
        kinds = kinds[:2] + list(libs) + kinds[2:]
    gen = torch.Generator().manual_seed(0)
    print(f"CPU: {cpu_model_name()}, {args.threads} threads; {args.layers} layers of "
          f"SmolLM2-135M's projection shapes; ms per pass over all of them")
    width = max(20, *(len(k) for k in kinds))
    print(f"{'rows':>6} " + " ".join(f"{k:>{width}}" for k in kinds) + "   fp32 / bf16 weights"
          + ("   vs REV: fp32, bf16 weights" if libs else ""))
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for r in range(args.rounds):
            for kind in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
                calls = build(kind, args.layers, gen)
                lib = libs.get(kind)
                one_pass(calls, xs, lib)  # untimed: first touches
                times[kind].append(min(one_pass(calls, xs, lib) for _ in range(args.passes)))
                del calls
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        line = (f"{rows:>6} " + " ".join(f"{med[k]:>{width}.2f}" for k in kinds)
                + f"   {med['native fp32'] / med['native bf16 weights']:.2f}x")
        if libs:
            line += "   " + ", ".join(f"{med[f'{k} @ {args.against}'] / med[k]:.2f}x"
                                      for k in kinds[:2])
        print(line)
        sys.stdout.flush()
    x = torch.randn(args.prefill_rows, 576, generator=gen)
    w = (torch.randn(3072, 576, generator=gen) * 0.02).to(torch.bfloat16)
    mods = {"native fp32": ops.PackedGemm(w.float().contiguous(), None, True),
            "native bf16 weights": ops.PackedGemm(w.contiguous(), None, True)}
    prefill = {k: [] for k in mods}
    for _ in range(args.rounds * 3):
        for kind, fn in mods.items():
            t = time.perf_counter()
            fn(x)
            prefill[kind].append(time.perf_counter() - t)
    print(f"prefill, {args.prefill_rows} rows x one 3072x576 gate/up weight (+ SwiGLU), "
          "ms: " + ", ".join(f"{k} {statistics.median(v) * 1e3:.2f}"
                              for k, v in prefill.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
