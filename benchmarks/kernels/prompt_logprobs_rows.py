"""Where prompt logprobs' time goes, per slice of rows: the LM head GEMM against the
reductions over its logits (torch's passes one by one, and the fused row kernel).

The engine's own LM head (SmolLM2-135M's shape by default, dummy weights, the backend the
engine chose for it) computes the logits of ``--rows`` prompt positions in slices of each
``--slices`` size; each slice is then reduced by the torch path's passes (upcast,
log_softmax, gather, rank, top-k) and by ``kernels/cpu/logprob_rows.c``. Figures are ms
over all rows (median of ``--rounds``) and the share of the head GEMM in the sum.

    python -m benchmarks.kernels.prompt_logprobs_rows --rounds 3
    python -m benchmarks.kernels.prompt_logprobs_rows --model llama3-8b-head --rows 512 \
        --slices 32,64,128 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.steps.prompt_logprobs import model_path
from conveyor import LLM
from conveyor.kernels.cpu import logprob_rows
from conveyor.kernels.cpu.cpuinfo import cpu_model_name
from conveyor.runner.prompt_logprobs import reduce_rows_torch


def timed(fn: Callable[[], object], rounds: int) -> float:
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", choices=("smollm2-135m", "llama3-8b-head"),
                   help="llama3-8b-head: one Llama-3-8B layer and its 128256 x 4096 head")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rows", type=int, default=2047, help="prompt positions scored")
    p.add_argument("--slices", default="32,64,128,256", help="rows per slice")
    p.add_argument("--k", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(model_path(args.model), dtype=args.dtype, max_num_seqs=8, load_format="dummy",
              enable_prefix_caching=False)
    model = llm.engine.runner.model
    hidden_size = model.cfg.hidden_size
    compute_dtype = model.embed_tokens.weight.dtype
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.rows, hidden_size, generator=gen).to(compute_dtype)
    with torch.inference_mode():
        vocab = model.compute_logits(hidden[:1]).shape[1]
    targets = torch.randint(0, vocab, (args.rows,), generator=gen)
    lib = logprob_rows.load()
    print(f"CPU: {cpu_model_name()}, {args.threads} threads, {args.model} head "
          f"[{vocab} x {hidden_size}] in {compute_dtype}, {args.rows} rows, k={args.k}; "
          f"ms over all rows, median of {args.rounds}")
    for rows in (int(s) for s in args.slices.split(",")):
        parts = measure(model, hidden, targets, rows, args.k, args.rounds, lib)
        head = parts["head GEMM"]
        torch_post = sum(v for n, v in parts.items() if n in TORCH_PASSES)
        print(f"  slices of {rows:4d} rows: " + ", ".join(
            f"{n} {v * 1e3:.1f}" for n, v in parts.items()))
        print(f"    torch passes {torch_post * 1e3:.1f} ms = {torch_post / head:.2f}x the head "
              f"GEMM (head share of head+passes {head / (head + torch_post):.0%})" + (
                  f"; fused {parts['fused kernel'] / head:.2f}x the head GEMM, "
                  f"{torch_post / parts['fused kernel']:.1f}x faster than the passes; "
                  f"GEMM then kernel slice by slice {parts['GEMM+fused'] / head:.2f}x the "
                  f"head GEMM, GEMM then torch {parts['GEMM+torch'] / head:.2f}x"
                  if "fused kernel" in parts else ""))


TORCH_PASSES = ("upcast", "log_softmax", "gather", "rank", "top-k")


def measure(model, hidden: torch.Tensor, targets: torch.Tensor, rows: int, k: int,
            rounds: int, lib) -> dict[str, float]:
    """ms of each part over all rows, in slices of ``rows``."""
    slices = [(lo, min(lo + rows, hidden.shape[0])) for lo in range(0, hidden.shape[0], rows)]
    parts: dict[str, float] = {}
    with torch.inference_mode():
        logits = {lo: model.compute_logits(hidden[lo:hi]) for lo, hi in slices}
        parts["head GEMM"] = timed(
            lambda: [model.compute_logits(hidden[lo:hi]) for lo, hi in slices], rounds)
        upcast = {lo: x.float() for lo, x in logits.items()}
        lps = {lo: torch.log_softmax(x, dim=-1) for lo, x in upcast.items()}
        scored = {lo: upcast[lo].gather(1, targets[lo:hi, None]) for lo, hi in slices}
        parts["upcast"] = timed(lambda: [x.float() for x in logits.values()], rounds)
        parts["log_softmax"] = timed(
            lambda: [torch.log_softmax(x, dim=-1) for x in upcast.values()], rounds)
        parts["gather"] = timed(
            lambda: [lps[lo].gather(1, targets[lo:hi, None]) for lo, hi in slices], rounds)
        parts["rank"] = timed(lambda: [(upcast[lo] > scored[lo]).sum(1, dtype=torch.int32)
                                       for lo, _ in slices], rounds)
        parts["top-k"] = timed(lambda: [
            upcast[lo].max(-1) if k == 1 else torch.topk(upcast[lo], k, dim=-1)
            for lo, _ in slices], rounds)
        parts["GEMM+torch"] = timed(lambda: [reduce_rows_torch(
            model.compute_logits(hidden[lo:hi]).float(), targets[lo:hi], k)
            for lo, hi in slices], rounds)
        if lib is not None:
            parts["fused kernel"] = timed(lambda: [logprob_rows.reduce_rows(
                upcast[lo], targets[lo:hi], k, lib) for lo, hi in slices], rounds)
            parts["GEMM+fused"] = timed(lambda: [logprob_rows.reduce_rows(
                model.compute_logits(hidden[lo:hi]).float(), targets[lo:hi], k, lib)
                for lo, hi in slices], rounds)
    return parts


if __name__ == "__main__":
    main()
