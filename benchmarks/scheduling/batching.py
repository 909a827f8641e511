"""Static against continuous batching on a sample of the Azure conversation trace.

    python -m benchmarks.scheduling.batching   # tiny and smollm2-135m, dummy weights
    python -m benchmarks.scheduling.batching --models tiny --repeats 5 --num-threads 2

For each model: a seeded random sample of ``azure_conv_2023.csv`` (token counts scaled
to fit a CPU, every request present at t=0, several times more requests than
``max_num_seqs``) runs through ``load_format="dummy"`` static, continuous, continuous,
static, ... in one process. It prints generated tokens/s of both, their ratio, and the
ratio against two ideals for that sample (see ``conveyor.bench.ideal``):

- slot ideal: static steps / continuous steps, right when a step costs the same at any
  batch size;
- cost ideal: both schedules' decode steps weighted by the decode-step time per batch size
  that the script measures first (on a CPU a bigger batch costs more).

Each model's run is also ``conveyor bench --compare-batching`` with the printed options.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

from benchmarks.common import traces_dir
from conveyor.bench.batching import HEADLINE_HEADER, headline_row
from conveyor.bench.cli import study
from conveyor.bench.report import table

DEFAULT_TRACE = os.path.join(traces_dir(),
                             "azure_conv_2023.csv")

# Per model: slots, sample size (4-6x the slots), scales that keep one run within a minute
# or two on 2 CPU cores, and runs per mode. The samples' means: tiny, prompts 142 and
# outputs 114 tokens (max 496); smollm2-135m, prompts 48 and outputs 14 (max 40).
CONFIGS = {
    "tiny": dict(max_num_seqs=16, num_requests=96, input_scale=0.125, output_scale=0.5,
                 max_num_batched_tokens=2048, repeats=3),
    "smollm2-135m": dict(max_num_seqs=8, num_requests=32, input_scale=0.0625,
                         output_scale=0.0625, max_num_batched_tokens=1024, repeats=2),
}


def model_argv(model: str, trace: str, seed: int, num_threads: int | None) -> list[str]:
    c = CONFIGS[model]
    argv = ["--model", model, "--load-format", "dummy", "--dtype", "float32",
            "--workload", trace, "--sample", "random", "--seed", str(seed),
            "--num-requests", str(c["num_requests"]), "--request-rate", "inf",
            "--input-scale", str(c["input_scale"]), "--output-scale", str(c["output_scale"]),
            "--max-num-seqs", str(c["max_num_seqs"]),
            "--max-num-batched-tokens", str(c["max_num_batched_tokens"])]
    if num_threads:
        argv += ["--num-threads", str(num_threads)]
    return argv


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,smollm2-135m",
                   help=f"comma-separated, from {', '.join(CONFIGS)}")
    p.add_argument("--trace", default=DEFAULT_TRACE)
    p.add_argument("--repeats", type=int, default=None,
                   help="runs per mode, alternating (default: 3 for tiny, 2 for smollm2-135m)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads (default: all cores)")
    p.add_argument("--verbose", action="store_true", help="print the full tables")
    p.add_argument("--out", default=None, help="save the headline figures as JSON")
    args = p.parse_args()
    if not os.path.isfile(args.trace):
        print(f"trace not found: {args.trace} (set --trace or CONVEYOR_TRACES)",
              file=sys.stderr)
        return 2
    import torch

    rows, saved = [], {}
    for model in args.models.split(","):
        if model not in CONFIGS:
            print(f"unknown model {model!r}; choose from {', '.join(CONFIGS)}", file=sys.stderr)
            return 2
        argv = model_argv(model, args.trace, args.seed, args.num_threads)
        repeats = args.repeats or CONFIGS[model]["repeats"]
        print(f"\n== {model}: conveyor bench --compare-batching --repeats {repeats} "
              f"{shlex.join(argv)}")
        t0 = time.perf_counter()
        _, cmp = study(argv, repeats=repeats)
        print(f"   ({time.perf_counter() - t0:.0f}s, torch threads {torch.get_num_threads()})")
        if args.verbose:
            print(cmp.format())
        else:
            from conveyor.bench.batching import format_ideal

            print(format_ideal(cmp.ideal, cmp.throughput_ratio, cmp.costs, cmp.run_costs))
        rows.append(headline_row(model, cmp))
        saved[model] = {"argv": argv, "repeats": repeats, **cmp.headline(),
                        "static_tokens_per_s": cmp.throughputs("static"),
                        "continuous_tokens_per_s": cmp.throughputs("continuous")}
    print("\n" + table(["model", *HEADLINE_HEADER[1:]], rows))
    print("ratio = continuous/static generated tokens/s (medians over repeats); "
          "(reached) = ratio / ideal")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(saved, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
