"""Does a step cost more right after the engine sat idle? Back-to-back steps against steps
that follow an idle gap, on sim_fidelity.py's model and engine options, side by side.

    PYTHONPATH=src python -m benchmarks.experiments.step_after_idle [--idle-ms 30] [--rounds 3]

Why: the simulator's profile times steps back to back, while a real run at 70-85% load
often starts a step after waiting for an arrival (the step that serves a new request's
first token, typically). If those steps are slower, the simulator's TTFT comes out low.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

from benchmarks.sim.sim_fidelity import MODEL_CONFIG
from conveyor import LLM, SamplingParams


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--idle-ms", type=float, default=30.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="steps timed per kind and round")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(MODEL_CONFIG, f)
        llm = LLM(tmp, load_format="dummy", dtype="float32", num_threads=1, max_num_seqs=16,
                  max_num_batched_tokens=512, num_kv_blocks=2048, block_size=16)
    engine, rng = llm.engine, random.Random(0)
    for i in range(4):  # four requests decoding at context ~128
        engine.add_request({"prompt_token_ids": [rng.randrange(10, 8000) for _ in range(128)]},
                           SamplingParams(max_tokens=100_000, ignore_eos=True),
                           request_id=f"d{i}")
    for _ in range(5):
        engine.step()

    def timed() -> float:
        t = time.perf_counter()
        engine.step()
        return (time.perf_counter() - t) * 1e3

    hot_all, cold_all = [], []
    for r in range(args.rounds):
        hot = [timed() for _ in range(args.steps)]
        cold = []
        for _ in range(args.steps):
            time.sleep(args.idle_ms / 1e3)
            cold.append(timed())
        hot_all += hot
        cold_all += cold
        print(f"round {r + 1}: decode batch 4, back to back {statistics.median(hot):.2f} ms, "
              f"after {args.idle_ms:g} ms idle {statistics.median(cold):.2f} ms")
    h, c = statistics.median(hot_all), statistics.median(cold_all)
    print(f"all rounds: back to back {h:.2f} ms, after idle {c:.2f} ms ({c / h - 1:+.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
