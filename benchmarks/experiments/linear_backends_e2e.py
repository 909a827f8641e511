"""Whole-engine decode speed with each linear backend, side by side in one process.

One engine per backend (``auto``, the measured per-shape choice, then each candidate
forced), the same prompts, runs in alternation each round, so a drift of the machine's
speed moves them alike; prints ms per decode step (medians over rounds) and each one's
ratio to ``auto`` (the median of the per-round ratios). ``auto`` should be as fast as the
fastest forced backend: if one beats it, the choice's measurement does not see what a
decode step sees.

    python -m benchmarks.experiments.linear_backends_e2e --batches 1,16 --rounds 8,4
    python -m benchmarks.experiments.linear_backends_e2e --model smollm2-135m --load-format dummy
    python -m benchmarks.experiments.linear_backends_e2e --model smollm2-135m --load-format dummy \
        --batches 1,4,16,32 --rounds 6,4,3,3 --max-num-seqs 128   # a server's cap
    python -m benchmarks.experiments.linear_backends_e2e --dtype bfloat16   # bf16 weights; fp32
                                                  # arithmetic where the CPU lacks bf16
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

from conveyor import LLM, SamplingParams
from conveyor.kernels.cpu.cpuinfo import cpu_model_name
from conveyor.model.dtypes import resolve_compute_dtype
from conveyor.model.linear.registry import linear_backend_names_for


def default_model() -> tuple[str, str]:
    """The trained spec pair's target if it is cached here (``spec_pair.py``'s cache, not
    trained now), else a preset (dummy)."""
    from benchmarks.spec import spec_pair

    target = os.path.join(spec_pair.default_cache_dir(), "target")
    if os.path.isfile(os.path.join(target, "config.json")):
        return target, "auto"
    return "smollm2-135m", "dummy"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint path or preset")
    p.add_argument("--load-format", default=None)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--rounds", default="8,4", help="one number, or one per batch size")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="the engines' cap (default: the largest batch): auto times decode "
                        "rows at it")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the checkpoint's dtype (bfloat16: computed as --compute-dtype auto "
                        "decides here)")
    args = p.parse_args()
    model, load_format = default_model()
    model = args.model or model
    load_format = args.load_format or (load_format if args.model is None else "auto")
    batches = [int(b) for b in args.batches.split(",")]
    rounds = [int(r) for r in args.rounds.split(",")]
    if len(rounds) == 1:
        rounds *= len(batches)
    if len(rounds) != len(batches):
        p.error("--rounds: one number, or one per batch size")
    cpu = torch.device("cpu")
    math = getattr(torch, resolve_compute_dtype("auto", args.dtype, cpu))
    weight_dtype = getattr(torch, args.dtype)
    names = ["auto", *linear_backend_names_for(
        cpu, math, weight_dtype if weight_dtype != math else None)]
    max_len = args.prompt_tokens + args.max_tokens + 16
    engines = {n: LLM(model, load_format=load_format, dtype=args.dtype,
                      max_num_seqs=args.max_num_seqs or max(batches),
                      max_num_batched_tokens=1024,
                      enable_prefix_caching=False, max_model_len=max_len,
                      num_threads=args.threads, linear_backend=n) for n in names}
    print(f"CPU: {cpu_model_name()} ({os.cpu_count()} cores); model {model}, {args.dtype} "
          f"weights, {str(math).removeprefix('torch.')} arithmetic")
    print(f"auto's choice: {engines['auto'].engine.runner.linear_choice or '(one backend)'}")
    vocab = engines["auto"].engine.config.model.vocab_size
    rng = random.Random(0)

    def prompt() -> dict:
        return {"prompt_token_ids": [rng.randrange(3, vocab)
                                     for _ in range(args.prompt_tokens)]}

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = [prompt()]
    for llm in engines.values():
        llm.generate(first, SamplingParams(max_tokens=8, temperature=0.0))
    for batch, n_rounds in zip(batches, rounds, strict=True):
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(n_rounds):
            prompts = [prompt() for _ in range(batch)]
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                engines[n].generate(first, warm)  # its weights back in the caches' way
                t = time.perf_counter()
                engines[n].generate(prompts, params)
                times[n].append(time.perf_counter() - t)
        print(f"\nbatch {batch}: median of {n_rounds} rounds, {args.max_tokens} tokens each")
        for n in names:
            ratio = statistics.median(a / b for a, b in zip(times["auto"], times[n]))
            print(f"  {n:<11} {statistics.median(times[n]) / args.max_tokens * 1e3:8.2f} ms "
                  f"a step   {ratio:5.3f}x auto's speed")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
