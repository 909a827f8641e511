"""What async scheduling saves: the same requests generated with and without
``--async-scheduling``, in alternation, wall time and steps per second per run.

    python -m benchmarks.steps.async_scheduling --model tiny --requests 64 --rounds 3

On the CPU the model and the scheduler share the cores: what overlaps is the host work
of scheduling and updating against the forward pass's torch ops (which release the GIL).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from conveyor import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 2000) for _ in range(args.input_len)]}
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    engines = {mode: LLM(args.model, load_format="dummy", dtype="float32",
                         max_num_seqs=args.max_num_seqs, async_scheduling=mode)
               for mode in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, list[list[int]]] = {}
    for llm in engines.values():  # a first round each, not counted (first touches)
        llm.generate(prompts, params)
    for _ in range(args.rounds):
        for mode, llm in engines.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            times[mode].append(time.perf_counter() - t0)
            tokens[mode] = [o.outputs[0].token_ids for o in outs]
    assert tokens[True] == tokens[False], "async scheduling changed the tokens"
    steps = engines[False].stats()["num_steps"] / (args.rounds + 1)
    for mode in (False, True):
        t = statistics.median(times[mode])
        print(f"{'async' if mode else 'sync ':5s}: {t:6.3f} s median of {args.rounds} "
              f"({', '.join(f'{x:.3f}' for x in times[mode])}), {steps / t:7.1f} steps/s, "
              f"{args.requests * args.output_len / t:8.1f} tokens/s")
    # What overlapping can hide at most: the host's schedule + update per synchronous step.
    phases = engines[False].engine.core.timings.mean_ms()
    print("sync step phases, mean ms: " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()))
    ratio = statistics.median(times[True]) / statistics.median(times[False])
    print(f"async/sync wall time: {ratio:.3f}")


if __name__ == "__main__":
    main()
