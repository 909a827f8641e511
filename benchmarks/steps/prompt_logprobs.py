"""Prefill throughput with and without prompt logprobs, side by side.

The engine (offline, SmolLM2-135M's shape, dummy weights) prefills one 2,048-token prompt
in one step, asking for no prompt logprobs, for k = 1 and for k = 5; the modes alternate
within each round (drift hits them alike) and each mode's median step is set against
the no-logprobs one. What requests that do not ask pay is this tree's no-logprobs step
against another tree's (``benchmarks.against_tree``).

    python -m benchmarks.steps.prompt_logprobs --dtype bfloat16 --rounds 5
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from conveyor import LLM, SamplingParams
from conveyor.kernels.cpu.cpuinfo import cpu_model_name

TOKENS = 2048


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ks", default="1,5", help="the prompt_logprobs values to time")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM("smollm2-135m", dtype=args.dtype, max_num_seqs=8, max_num_batched_tokens=TOKENS,
              load_format="dummy", enable_prefix_caching=False)
    engine = llm.engine
    rng = random.Random(0)
    modes: list[int | None] = [None, *(int(k) for k in args.ks.split(","))]

    def one_step(tag: str, k: int | None) -> float:
        ids = [rng.randrange(10, 40000) for _ in range(TOKENS)]
        engine.add_request({"prompt_token_ids": ids},
                           SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0,
                                          prompt_logprobs=k), request_id=tag)
        t = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t
        while engine.has_unfinished_requests():
            engine.step()
        return wall

    for k in modes:
        one_step(f"warmup-{k}", k)
    walls: dict[int | None, list[float]] = {k: [] for k in modes}
    for r in range(args.rounds):
        order = modes if r % 2 == 0 else modes[::-1]
        for k in order:
            walls[k].append(one_step(f"r{r}-{k}", k))
    base = statistics.median(walls[None])
    print(f"CPU: {cpu_model_name()}, {args.dtype}, {args.threads} threads, one {TOKENS}-token "
          f"prompt per step, median of {args.rounds} (modes alternate within a round)")
    for k in modes:
        wall = statistics.median(walls[k])
        name = "no prompt logprobs" if k is None else f"prompt_logprobs={k}"
        print(f"  {name:20s} step {wall * 1e3:8.1f} ms  {TOKENS / wall:8.0f} tokens/s  "
              f"{wall / base:.3f}x  (steps {', '.join(f'{w * 1e3:.0f}' for w in walls[k])})")


if __name__ == "__main__":
    main()
