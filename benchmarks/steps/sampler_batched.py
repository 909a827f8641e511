"""The sampler's step at a batch of penalized rows with logprobs: the batched device path
against the per-row loops it replaced (same tokens; host time per call).

    python -m benchmarks.steps.sampler_batched --batch 64 --vocab 32000
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from conveyor.runner.sampler import Sampler, SamplingRow
from conveyor.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    rng = random.Random(0)
    dev = torch.device(args.device)
    rows = [SamplingRow(SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1,
                                       frequency_penalty=0.2, presence_penalty=0.1,
                                       min_tokens=4, logprobs=5, max_tokens=64),
                        [rng.randrange(args.vocab) for _ in range(512)],
                        [rng.randrange(args.vocab) for _ in range(rng.randint(0, 128))])
            for _ in range(args.batch)]
    logits = torch.randn(args.batch, args.vocab, device=dev) * 3
    for label in ("per-row loops", "batched"):
        s = Sampler(args.vocab, dev, seed=0)
        if label == "per-row loops":
            s._apply_penalties, s._block_stops = s._apply_penalties_per_row, s._block_stops_per_row
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            s(logits, rows)
            times.append(time.perf_counter() - t0)
        print(f"{label:14s} batch {args.batch} vocab {args.vocab}: "
              f"{statistics.median(times) * 1e3:7.2f} ms per call (median of {args.reps})")


if __name__ == "__main__":
    main()
