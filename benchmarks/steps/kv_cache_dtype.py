"""Decode steps over a long context with the native attention backend: the compute-dtype KV
cache against the one-byte ones of ``--kv-cache-dtype``, side by side in one process.

One engine per cache dtype, each decoding ``--batch`` requests of ``--context`` prompt
tokens (prefilled first); then rounds in which every engine times ``--steps`` decode steps
in turn (the order rotates each round, so machine drift hits every arm alike). Prints each
arm's median step, its ratio to the first arm, and the KV pool's capacity in tokens at
``--kv-memory-gib`` for every cache dtype (a bf16 cache's too, where the CPU computes bf16
in float32 and so keeps a float32 cache).

    python -m benchmarks.steps.kv_cache_dtype --batch 8 --context 2048

``--kernel`` times the native decode attention call alone instead (no engine, no
prefill: quick), on the model's heads over ``--kernel-layers`` layers' pools of
``--batch`` x ``--context`` random tokens at shuffled slots, each arm's pools written
through its own path (``QuantizedKV``'s native write for the one-byte ones).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

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


def kernel_times(args, arms: list[str]) -> tuple[dict[str, list[float]], object]:
    """Seconds per layer of the native decode attention per arm, ``--rounds`` rounds."""
    from conveyor.config.model import load_model_config
    from conveyor.config.presets import resolve_model_path
    from conveyor.kernels.cpu import ops
    from conveyor.model.quant.kv_cache import QuantizedKV

    cfg = load_model_config(resolve_model_path(args.model, "dummy"), dtype=args.dtype)
    b, ctx, hq, hkv, d = args.batch, args.context, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    n = b * ctx
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(n, generator=gen).view(b, ctx)
    lens = torch.full((b,), ctx, dtype=torch.int32)
    starts = torch.zeros(b, dtype=torch.int32)
    q = torch.randn(b, hq, d, generator=gen)
    pools: dict[str, list] = {kv: [] for kv in arms}
    for _ in range(args.kernel_layers):
        k, v = (torch.randn(n, hkv, d, generator=gen) for _ in range(2))
        for kv in arms:
            if kv == "auto":
                pools[kv].append((k, v))
                continue
            pair = []
            for x in (k, v):
                pool = QuantizedKV(n, hkv, d, kv, torch.float32, torch.device("cpu"), True)
                pool.index_copy_(0, torch.arange(n), x)
                pair.append(pool)
            pools[kv].append(tuple(pair))

    def run(kv: str) -> None:
        for k, v in pools[kv]:
            if kv == "auto":
                ops.decode_attention(q, k, v, slots, lens, starts, d ** -0.5)
            else:
                ops.decode_attention_q8(q, k.data, k.scale, v.data, v.scale, slots, lens,
                                        starts, d ** -0.5)

    times: dict[str, list[float]] = {kv: [] for kv in arms}
    for r in range(args.rounds):
        for kv in arms[r % len(arms):] + arms[:r % len(arms)]:
            t = time.perf_counter()
            for _ in range(args.steps):
                run(kv)
            times[kv].append((time.perf_counter() - t) / (args.steps * args.kernel_layers))
    return times, cfg


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
    p.add_argument("--kernel", action="store_true",
                   help="time the decode attention kernel alone (a float32 pool for auto)")
    p.add_argument("--kernel-layers", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    arms = args.kv.split(",")
    if args.kernel:
        times, cfg = kernel_times(args, arms)
        print(f"{cpu_model_name()}, {args.threads} threads; decode attention alone, "
              f"{args.model}'s heads ({cfg.num_heads} q, {cfg.num_kv_heads} kv, dim "
              f"{cfg.head_dim}), batch {args.batch}, context {args.context}, {args.rounds} "
              f"rounds x {args.steps} calls x {args.kernel_layers} layers")
        base = statistics.median(times[arms[0]])
        for kv in arms:
            med = statistics.median(times[kv])
            print(f"kv {kv:9s} attention {med * 1e3:8.3f} ms/layer  ratio {base / med:5.2f}x "
                  f"(vs {arms[0]})")
        return
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
