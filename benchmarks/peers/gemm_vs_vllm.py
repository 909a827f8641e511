"""A prefill step's fp32 projections through vLLM's CPU GEMM, conveyor's and torch's oneDNN,
in one process: the GEMMs behind the peers table's fp32 TTFT, side by side.

Runs in vLLM's own venv (the peers harness installs it), with conveyor's sources on the
path, so that vLLM's ``onednn_mm`` (what its CPU linears call) is the one it ships:

    PYTHONPATH=src ~/.cache/conveyor/peers/vllm/venv/bin/python \
        benchmarks/peers/gemm_vs_vllm.py --rows 512,2048

Each pass is a layer's four projections of SmolLM2-135M (QKV, O, gate/up as one plain
[3072, 576] product, down: no fused activation, so that all three compute the same
thing), the backends in alternating order each round; the table is ms for 30 layers
(the median pass x 30).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="512,2048")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from vllm import _custom_ops as vllm_ops  # only in vLLM's venv

    from conveyor.kernels.cpu import ops
    from conveyor.kernels.cpu.cpuinfo import cpu_model_name
    from conveyor.model.linear.onednn import PackedLinear

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * 0.02 for n, k in SHAPES]
    handles = [vllm_ops.create_onednn_mm(w.t(), 32) for w in weights]
    native = [ops.PackedGemm(w.contiguous(), None, False) for w in weights]
    onednn = [PackedLinear(w, None) for w in weights]
    calls = {
        "vLLM onednn_mm": lambda i, x: vllm_ops.onednn_mm(handles[i], x, None),
        "conveyor GEMM": lambda i, x: native[i](x),
        "torch oneDNN": lambda i, x: onednn[i](x),
    }
    print(f"CPU: {cpu_model_name()}, {args.threads} threads, fp32; ms for 30 layers' "
          "projections (median of alternating rounds)")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen) for k in (576, 1536)}

        def one_pass(fn, xs=xs) -> float:
            t = time.perf_counter()
            for i, w in enumerate(weights):
                fn(i, xs[w.shape[1]])
            return time.perf_counter() - t

        times: dict[str, list[float]] = {name: [] for name in calls}
        for fn in calls.values():
            one_pass(fn)
        names = list(calls)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                times[name].append(one_pass(calls[name]))
        cells = ", ".join(f"{name} {statistics.median(ts) * 30e3:.0f}"
                          for name, ts in times.items())
        print(f"{rows:5d} rows: {cells}", flush=True)


if __name__ == "__main__":
    main()
