"""Decode steps over a long context with the native attention backend: the compute-dtype KV
cache against the one-byte ones of ``--kv-cache-dtype``, side by side in one process.

One engine per cache dtype, each decoding ``--batch`` requests of ``--context`` prompt
tokens (prefilled first); then rounds in which every engine times ``--steps`` decode steps
in turn (the order rotates each round, so machine drift hits every arm alike). Prints each
arm's median step, its ratio to the first arm, and the KV pool's capacity in tokens at
``--kv-memory-gib`` for every cache dtype (a bf16 cache's too, where the CPU computes bf16
in float32 and so keeps a float32 cache).

    python -m benchmarks.steps.kv_cache_dtype --batch 8 --context 2048
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from benchmarks.common import median_step_s, start_decoding
from conveyor import LLM
from conveyor.kernels.cpu.cpuinfo import cpu_model_name


def build(args, kv: str) -> LLM:
    blocks = args.batch * (-(-(args.context + args.rounds * args.steps + 8) // 16)) + 8
    llm = LLM(args.model, dtype=args.dtype, load_format="dummy", kv_cache_dtype=kv,
              attention_backend=args.attention_backend, max_num_seqs=args.batch,
              max_num_batched_tokens=args.prefill_chunk, num_kv_blocks=blocks,
              block_size=16, max_model_len=args.context + args.rounds * args.steps + 64)
    start_decoding(llm, args.batch, args.context, max_tokens=10_000)
    return llm


def capacity_tokens(llm: LLM, gib: float) -> dict[str, int]:
    """Tokens a pool of ``gib`` GiB holds under each cache dtype (block rounding aside)."""
    cfg = llm.engine.config.model
    out = {}
    for label, kv, dtype in (("float32", "auto", "float32"), ("bfloat16", "auto", "bfloat16"),
                             ("int8", "int8", cfg.math_dtype),
                             ("fp8", "fp8_e4m3", cfg.math_dtype)):
        c = dataclasses.replace(cfg, kv_cache_dtype=kv, dtype=dtype, compute_dtype=None)
        out[label] = int(gib * 2**30 // c.kv_bytes_per_token)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv", default="auto,int8,fp8_e4m3,fp8_e5m2",
                   help="cache dtypes, the first the baseline of the ratios")
    p.add_argument("--attention-backend", default="native")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=5, help="timed steps per arm per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--prefill-chunk", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-memory-gib", type=float, default=1.0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    arms = args.kv.split(",")
    engines = {kv: build(args, kv) for kv in arms}
    cfg = engines[arms[0]].engine.config.model
    times: dict[str, list[float]] = {kv: [] for kv in arms}
    for r in range(args.rounds):
        order = arms[r % len(arms):] + arms[:r % len(arms)]
        for kv in order:
            times[kv].append(median_step_s(engines[kv], args.steps))
    print(f"{cpu_model_name()}, {args.threads} threads; {args.model} {cfg.dtype_label}, "
          f"{engines[arms[0]].engine.runner.attention.name} attention, batch {args.batch}, "
          f"context {args.context}+, {args.rounds} rounds x {args.steps} steps")
    base = statistics.median(times[arms[0]])
    for kv in arms:
        med = statistics.median(times[kv])
        per_token = engines[kv].engine.config.model.kv_bytes_per_token
        print(f"kv {kv:9s} decode step {med * 1e3:8.2f} ms  ratio {base / med:5.2f}x "
              f"(vs {arms[0]})  KV {per_token} B/token, "
              f"{per_token * args.batch * args.context / 2**20:.0f} MiB read a step")
    caps = capacity_tokens(engines[arms[0]], args.kv_memory_gib)
    print(f"pool capacity at {args.kv_memory_gib:g} GiB (tokens): "
          + ", ".join(f"{k} {v}" for k, v in caps.items()))


if __name__ == "__main__":
    main()
