"""Data-parallel routing in the simulator: ``prefix`` (``conveyor router``'s own policy)
against ``least_loaded`` and ``round_robin`` (and the simulator's older
``prefix_affinity``) on a trace, for several replica counts.

    PYTHONPATH=src python -m benchmarks.sim.dp_router   # Mooncake, 4 and 8 H100s
    PYTHONPATH=src python -m benchmarks.sim.dp_router --num-requests 1000 --time-scale 0.25

Any other ``conveyor sim`` option passes through (``--model``, ``--hardware``,
``--max-num-batched-tokens``, ...). Prints one row per (replicas, router): the share of
prompt tokens served from the prefix cache, TTFT p50 / p99, TPOT p50, goodput under
``--slo-ttft`` / ``--slo-tpot`` and the spread of requests over replicas. A trace that is
not there is skipped with a message (exit 0).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks.common import SHARED_TRACES
from conveyor.entrypoints.cli import build_parser

DEFAULT_TRACE = os.path.join(SHARED_TRACES, "mooncake_synthetic.jsonl")
DEFAULTS = ["--model", "llama3-8b", "--hardware", "h100", "--max-num-seqs", "256",
            "--max-num-batched-tokens", "8192", "--slo-ttft", "2000", "--slo-tpot", "50"]
ROUTERS = ("prefix", "least_loaded", "round_robin", "prefix_affinity")


def main(argv: list[str] | None = None) -> int:
    own = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    own.add_argument("--replica-counts", default="4,8")
    own.add_argument("--routers", default=",".join(ROUTERS))
    mine, rest = own.parse_known_args(argv)
    if "--workload" not in rest:
        rest = ["--workload", os.path.normpath(DEFAULT_TRACE), *rest]
    args = build_parser("sim").parse_args(["sim", *DEFAULTS, *rest])
    if not os.path.exists(args.workload):
        print(f"skipped: no trace at {args.workload}")
        return 0

    from conveyor.sim.cli import describe, sim_inputs
    from conveyor.sim.results import run_result
    from conveyor.sim.simulator import Simulator

    engine_args, model, cost, requests = sim_inputs(args)

    print(f"workload: {args.workload}: {describe(requests)}")
    print(f"cost model: {cost.describe()}; SLOs TTFT <= {args.slo_ttft:g} ms, "
          f"TPOT <= {args.slo_tpot:g} ms")
    print(f"{'replicas':>8} {'router':>16} {'hit rate':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>9} {'goodput':>8} {'failed':>6}  requests per replica  [wall]")
    for n in (int(x) for x in mine.replica_counts.split(",")):
        for router in mine.routers.split(","):
            t0 = time.perf_counter()
            sim = Simulator(engine_args, cost, replicas=n, router=router, model=model)
            result = sim.run(requests)
            run = run_result(requests, result, sim)
            done = [r for r in run.records if not r.error]
            prompt = sum(r.prompt_tokens for r in done)
            hit = sum(r.num_cached_tokens for r in done) / prompt if prompt else 0.0
            s = run.summary
            ttft, tpot = s.latency["ttft"], s.latency["tpot"]
            print(f"{n:>8} {router:>16} {hit:>8.1%} {ttft.median:>9,.0f} {ttft.p99:>9,.0f} "
                  f"{tpot.median:>9.1f} {s.goodput or 0.0:>8.2f} {s.num_failed:>6}  "
                  f"{[r.num_requests for r in result.replicas]}  "
                  f"[{time.perf_counter() - t0:.1f}s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
