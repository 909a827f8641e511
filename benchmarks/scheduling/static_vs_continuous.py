"""Static against continuous batching: the seed's headline, on two workloads.

    python -m benchmarks.scheduling.static_vs_continuous   # tiny dummy model
    python -m benchmarks.scheduling.static_vs_continuous --model smollm2-135m --repeats 2

The same sampled requests run through both batching modes in one process (alternating,
fresh engine per run, all requests at t=0), for

- azure: a seeded random sample of the Azure 2023 conversation trace, scaled to this CPU
  (skipped when the shared traces folder is absent);
- wide-output: the synthetic ``wide-output`` preset, outputs uniform over a wide range
  (static batching holds each batch until its longest member ends).

Printed per workload: continuous/static generated tokens/s, static/continuous TTFT at
p50 and p99 (above 1: continuous answers sooner), and the ideal ratios for the sample
(slot ideal: static slot-steps over continuous ones; cost ideal: weighted by the step
time per batch size measured first). Each workload's run is also
``conveyor bench --compare-batching`` with the printed options.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from benchmarks.common import traces_dir
from conveyor.bench.cli import study
from conveyor.bench.report import table

TRACE = os.path.join(traces_dir(),
                     "azure_conv_2023.csv")

# model -> (slots, requests, batch token budget, {workload: (input scale, output scale)})
CONFIGS = {
    "tiny": (16, 96, 2048, {"azure": (0.125, 0.5), "wide-output": (0.125, 0.25)}),
    "smollm2-135m": (8, 32, 1024, {"azure": (0.0625, 0.0625),
                                   "wide-output": (0.0625, 0.03125)}),
}


def workload_argv(model: str, workload: str, seed: int, num_threads: int | None) -> list[str]:
    slots, num, budget, scales = CONFIGS[model]
    input_scale, output_scale = scales[workload]
    source = ["--workload", TRACE, "--sample", "random"] if workload == "azure" else \
        ["--workload", "wide-output"]
    argv = ["--model", model, "--load-format", "dummy", "--dtype", "float32", *source,
            "--seed", str(seed), "--num-requests", str(num), "--request-rate", "inf",
            "--input-scale", str(input_scale), "--output-scale", str(output_scale),
            "--max-num-seqs", str(slots), "--max-num-batched-tokens", str(budget)]
    if num_threads:
        argv += ["--num-threads", str(num_threads)]
    return argv


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=sorted(CONFIGS))
    p.add_argument("--workloads", default="azure,wide-output")
    p.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--verbose", action="store_true", help="print every full table")
    p.add_argument("--out", default=None, help="save the headline figures as JSON")
    args = p.parse_args()
    rows, saved = [], {}
    for workload in args.workloads.split(","):
        if workload not in ("azure", "wide-output"):
            print(f"unknown workload {workload!r}: azure or wide-output", file=sys.stderr)
            return 2
        if workload == "azure" and not os.path.isfile(TRACE):
            print(f"skipping azure: {TRACE} not found (set CONVEYOR_TRACES)")
            continue
        argv = workload_argv(args.model, workload, args.seed, args.num_threads)
        print(f"\n== {workload}: conveyor bench --compare-batching --repeats {args.repeats} "
              f"{shlex.join(argv)}")
        _, cmp = study(argv, repeats=args.repeats)
        print(cmp.format() if args.verbose else "")
        h = cmp.headline()
        rows.append([workload, f"{h['throughput_ratio']:.2f}x",
                     _x(h["ttft_p50_ratio_static_over_continuous"]),
                     _x(h["ttft_p99_ratio_static_over_continuous"]),
                     _x(h["slot_ideal"]), _x(h["cost_ideal"]), _x(h["cost_ideal_in_run"])])
        saved[workload] = {"argv": argv, "repeats": args.repeats, **h}
    if not rows:
        return 2
    print(table(["workload", "tokens/s cont/static", "TTFT p50 static/cont",
                 "TTFT p99 static/cont", "slot ideal", "cost ideal", "cost ideal in-run"],
                rows))
    print(f"model {args.model} (dummy weights); medians over {args.repeats} runs per mode")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(saved, f, indent=1)
    return 0


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


if __name__ == "__main__":
    sys.exit(main())
