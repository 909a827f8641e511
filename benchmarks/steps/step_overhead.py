"""The engine's CPU time per decode step outside the model, without a profiler.

Batch 32 (SmolLM2-135M's shape, dummy weights, context 256+): the step's wall time less
the runner's forward, logits and sampling phases (perf_counter around each) is what the
scheduler, the input preparation, the output update and the detokenizer cost a step.
The performance issue's target: under 2 ms in every dtype. ``decode_step.py``'s
breakdown reports the same under torch's profiler, which inflates small Python costs.

    python -m benchmarks.steps.step_overhead --dtype bfloat16
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from conveyor import LLM, SamplingParams
from conveyor.kernels.cpu.cpuinfo import cpu_model_name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM("smollm2-135m", dtype=args.dtype, max_num_seqs=args.batch,
              max_num_batched_tokens=8192, load_format="dummy",
              num_kv_blocks=args.batch * 40 + 8)
    rng = random.Random(0)
    for i in range(args.batch):
        llm.engine.add_request(
            {"prompt_token_ids": [rng.randrange(10, 1000) for _ in range(256)]},
            SamplingParams(max_tokens=10_000, ignore_eos=True, temperature=0.0),
            request_id=str(i))
    for _ in range(5):  # the prompts, then the first decode steps
        llm.engine.step()
    print(f"CPU: {cpu_model_name()}, {args.dtype}, batch {args.batch}, {args.threads} threads")
    for r in range(args.rounds):
        llm.engine.runner.timings.reset()
        t = time.perf_counter()
        for _ in range(args.steps):
            llm.engine.step()
        wall = (time.perf_counter() - t) / args.steps * 1e3
        ms = llm.engine.runner.timings.mean_ms()
        model = sum(ms.get(k, 0.0) for k in ("forward", "logits", "sample"))
        print(f"round {r}: step {wall:6.2f} ms, model (forward + logits + sample) "
              f"{model:6.2f} ms, CPU overhead {wall - model:5.2f} ms (input preparation "
              f"{ms.get('prepare', 0.0):.2f})")


if __name__ == "__main__":
    main()
