"""The mixture-of-experts block with its experts grouped (``gemm_f32_grouped``: all
gate/ups in one native call, then all downs, runs of an expert's panels a task) against one
GEMM call per active expert, on the same block and weights, side by side in one run;
and the grouped path routed and combined by torch's ops instead of ``moe_route.c``
(``torch-routed``). With ``--threads 1`` the clock is the thread's CPU time.

Mixtral-shaped block (hidden 768, 8 experts x intermediate 1024, top-2 by default),
float32, experts on conveyor's GEMM (``NativeLinear``). The outputs are asserted equal bit
for bit at every batch; rounds alternate the two paths; the median time of each is
printed with the ratio grouped / one-by-one (below 1: grouped is faster).

    python -m benchmarks.kernels.moe_grouped --threads 2
    python -m benchmarks.kernels.moe_grouped --threads 1 --batch 1,4,16

``--against REV`` times the grouped path with git revision REV's ``gemm.c`` too (built
with this tree's flags, same weights, rounds in turns) and prints this tree's time over
REV's: a kernel change's before and after in one run. The Qwen3-MoE peers shape:

    python -m benchmarks.kernels.moe_grouped --hidden 512 --intermediate 512 --experts 16 \
        --top-k 4 --batch 1,4,16 --against HEAD
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from conveyor.kernels.cpu import ops
from conveyor.model.layers.moe import SparseMoE
from conveyor.model.linear.native import NativeLinear, native_gemm_lib


def block(hidden: int, inter: int, experts: int, top_k: int) -> SparseMoE:
    lib = native_gemm_lib()
    if lib is None:
        raise SystemExit("conveyor's GEMM is unavailable here (needs AVX2 + FMA and the "
                         "native kernels built)")
    torch.manual_seed(0)
    moe = SparseMoE(hidden, inter, experts, top_k, renormalize=True)
    for e in moe.experts:
        e.gate_up_proj = NativeLinear(torch.randn(2 * inter, hidden) * 0.05, None, lib,
                                      gate_up=True)
        e.down_proj = NativeLinear(torch.randn(hidden, inter) * 0.05, None, lib)
    assert moe.grouped_gemms() is not None
    return moe


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,4,16,64,256")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=1024, help="per expert")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--against", metavar="REV", help="also time git revision REV's gemm.c")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    moe = block(args.hidden, args.intermediate, args.experts, args.top_k)
    print(f"{args.experts} experts x {args.intermediate}, top-{args.top_k}, hidden "
          f"{args.hidden}, float32, {args.threads} threads")
    libs = {"grouped": None}
    if args.against:
        libs[f"grouped @ {args.against}"] = gemm_at(args.against)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    print("batch  one-by-one ms  grouped ms  grouped/one-by-one  torch-routed ms  "
          "grouped/torch-routed"
          + (f"  grouped @ {args.against} ms  grouped/REV" if args.against else ""))
    for batch in [int(b) for b in args.batch.split(",")]:
        x = torch.randn(batch, args.hidden)
        grouped = moe(x)
        moe.grouped_gemms = lambda: None  # an instance attribute shadows the method
        assert torch.equal(grouped, moe(x)), f"batch {batch}: the two paths differ"
        del moe.grouped_gemms
        reps = 20 if batch <= 16 else 5
        times: dict[str, list[float]] = {name: [] for name in ("one", "torch", *libs)}
        own = ops._lib
        for _ in range(args.rounds):
            for name in times:
                if name == "one":
                    moe.grouped_gemms = lambda: None
                if name == "torch":  # grouped GEMMs, routed and combined by torch's ops
                    moe.forward_native = lambda x: None
                ops._lib = libs.get(name) or own
                t = clock()
                for _ in range(reps):
                    moe(x)
                times[name].append((clock() - t) / reps)
                ops._lib = own
                moe.__dict__.pop("grouped_gemms", None)
                moe.__dict__.pop("forward_native", None)
        med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
        one, grp, tr = med["one"], med["grouped"], med["torch"]
        line = f"{batch:5d}  {one:13.3f}  {grp:10.3f}  {grp / one:18.2f}  {tr:15.3f}  " \
               f"{grp / tr:20.2f}"
        if args.against:
            rev = med[f"grouped @ {args.against}"]
            line += f"  {rev:{len(args.against) + 13}.3f}  {grp / rev:10.2f}"
        print(line)


def gemm_at(rev: str):
    """The process's kernels with REV's GEMM entry points, the grouped one included."""
    import tempfile

    from benchmarks.common import GEMM_FUNCTIONS, Overlay, build_at

    return Overlay(ops._lib or ops._native(), build_at(rev, "gemm.c", tempfile.mkdtemp()),
                   (*GEMM_FUNCTIONS, "gemm_f32_grouped"))


if __name__ == "__main__":
    main()
