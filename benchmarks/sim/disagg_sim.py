"""Prefill/decode disaggregation at GPU scale, in the simulator: for N GPUs, every xPyD
split (x prefill + y decode replicas, x + y = N) against N colocated replicas, on the
Azure conversation trace, under TTFT <= 500 ms and TPOT <= 50 ms.

    PYTHONPATH=src python -m benchmarks.sim.disagg_sim   # 8 H100s, llama3-8b
    PYTHONPATH=src python -m benchmarks.sim.disagg_sim --gpus 4 --num-requests 500 --quick

Goodput here is the highest request rate (the trace's arrival pattern stretched or
compressed in time) at which at least 90% of requests meet both SLOs, found per
configuration by doubling then bisecting (each probe one full simulation); reported
in req/s for the whole fleet and per GPU. A KV transfer takes link latency +
bytes / bandwidth (``--link-gbps``, default 400 Gb/s per GPU; transfers do not
contend; conveyor.sim.disagg states the other simplifications). Any other
``conveyor sim`` option passes through (``--model``, ``--hardware``,
``--max-num-batched-tokens``, ...). A trace that is not there is skipped (exit 0).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

from benchmarks.common import SHARED_TRACES
from conveyor.entrypoints.cli import build_parser

DEFAULT_TRACE = os.path.join(SHARED_TRACES, "azure_conv_2023.csv")
DEFAULTS = ["--model", "llama3-8b", "--hardware", "h100", "--max-num-seqs", "256",
            "--max-num-batched-tokens", "8192", "--num-requests", "2000"]


def max_rate(attainment_at: Callable[[float], float], start: float, target: float,
             rel_tol: float = 0.03, max_probes: int = 20) -> tuple[float | None, int]:
    """The highest rate whose attainment is >= target (assumed to fall with the rate)."""
    lo = hi = None
    rate, n = start, 0
    while n < max_probes and (lo is None or hi is None):
        n += 1
        if attainment_at(rate) >= target:
            lo, rate = rate, rate * 2
        else:
            hi, rate = rate, rate / 2
    while lo is not None and hi is not None and hi / lo - 1 > rel_tol and n < max_probes:
        n += 1
        mid = (lo * hi) ** 0.5
        if attainment_at(mid) >= target:
            lo = mid
        else:
            hi = mid
    return lo, n


def main(argv: list[str] | None = None) -> int:
    own = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    own.add_argument("--gpus", type=int, default=8)
    own.add_argument("--link-gbps", type=float, default=400.0)
    own.add_argument("--ttft-ms", type=float, default=500.0)
    own.add_argument("--tpot-ms", type=float, default=50.0)
    own.add_argument("--attainment", type=float, default=0.9)
    own.add_argument("--quick", action="store_true", help="looser bisection (fewer probes)")
    mine, rest = own.parse_known_args(argv)
    if "--workload" not in rest:
        rest = ["--workload", DEFAULT_TRACE, *rest]
    args = build_parser("sim").parse_args(["sim", *DEFAULTS, *rest])
    if not os.path.exists(args.workload):
        print(f"skipped: no trace at {args.workload}")
        return 0

    from conveyor.sim.capacity import SLO, at_rate, slo_attainment
    from conveyor.sim.cli import describe, sim_inputs
    from conveyor.sim.disagg import DisaggSimulator, slo_goodput
    from conveyor.sim.simulator import Simulator

    engine_args, model, cost, requests = sim_inputs(args)
    slo = SLO(mine.ttft_ms / 1e3, mine.tpot_ms / 1e3, mine.attainment)
    times = sorted(r.arrival_s for r in requests)
    trace_rate = (len(times) - 1) / max(times[-1] - times[0], 1e-9)
    tol = 0.08 if mine.quick else 0.03

    print(f"workload: {args.workload}: {describe(requests)} (trace rate {trace_rate:.2f} "
          f"req/s)")
    print(f"cost model: {cost.describe()}; {mine.gpus} GPUs; SLOs TTFT <= {mine.ttft_ms:g} ms,"
          f" TPOT <= {mine.tpot_ms:g} ms for >= {mine.attainment:.0%} of requests; KV link "
          f"{mine.link_gbps:g} Gb/s per transfer, {model.kv_bytes_per_token:,} B/token")
    print(f"{'config':>10} {'goodput req/s':>14} {'per GPU':>8} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'probes':>6}  [wall]")

    def report(label: str, rate: float | None, probes: int, run_at, t0: float) -> None:
        if rate is None:
            print(f"{label:>10} {'none':>14}  (misses the SLO at every rate tried)")
            return
        finished = run_at(rate)
        ttft = sorted(m.ttft * 1e3 for m in finished.values() if m.ttft is not None)
        tpot = sorted(m.tpot * 1e3 for m in finished.values() if m.tpot is not None)

        def q(xs: list[float], p: float) -> float:
            return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")

        print(f"{label:>10} {rate:>14.2f} {rate / mine.gpus:>8.2f} {q(ttft, .5):>9,.0f} "
              f"{q(ttft, .99):>9,.0f} {q(tpot, .5):>9.1f} {q(tpot, .99):>9.1f} {probes:>6}  "
              f"[{time.perf_counter() - t0:.0f}s]", flush=True)

    colo = Simulator(engine_args, cost, replicas=mine.gpus, router="least_loaded",
                     model=model)

    def colo_finished(rate: float):
        return colo.run(at_rate(requests, rate)).finished

    def colo_att(rate: float) -> float:
        return slo_attainment(colo.run(at_rate(requests, rate)), slo, len(requests))

    t0 = time.perf_counter()
    rate, n = max_rate(colo_att, trace_rate, mine.attainment, tol)
    report(f"{mine.gpus} colo", rate, n, colo_finished, t0)
    for x in range(1, mine.gpus):
        sim = DisaggSimulator(engine_args, cost, num_prefill=x, num_decode=mine.gpus - x,
                              link_bytes_per_s=mine.link_gbps * 1e9 / 8, model=model)

        def finished_at(rate: float, sim=sim):
            return sim.run(at_rate(requests, rate)).finished

        def att(rate: float, sim=sim) -> float:
            res = sim.run(at_rate(requests, rate))
            return slo_goodput(res.finished, len(requests), slo.ttft_s, slo.tpot_s, 1.0)[0]

        t0 = time.perf_counter()
        rate, n = max_rate(att, trace_rate, mine.attainment, tol)
        report(f"{x}P{mine.gpus - x}D", rate, n, finished_at, t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
