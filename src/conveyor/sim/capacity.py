"""Capacity search: the fewest replicas, or the highest rate per replica, that meet SLOs.

A request meets the SLO if it finished normally, its TTFT is at most ``ttft_s``
and its TPOT (mean time per output token after the first; none for one-token
outputs) at most ``tpot_s``; refused and unfinished requests miss. Attainment is
the share of the workload's requests that meet it.

Both searches assume attainment does not fall as replicas are added or as the
request rate falls; they grow the probe geometrically until the outcome flips,
then bisect. Each probe is a full simulation, cut short as soon as more requests
have missed than the target allows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from conveyor.config import EngineArgs
from conveyor.costs.protocol import MachineCostModel
from conveyor.outputs import RequestMetrics
from conveyor.sim.replica import WorkloadRequest
from conveyor.sim.simulator import SimResult, Simulator

if TYPE_CHECKING:
    from conveyor.bench.workload import BenchRequest


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None
    attainment: float = 0.9

    def __post_init__(self) -> None:
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")
        if self.ttft_s is None and self.tpot_s is None:
            raise ValueError("an SLO needs a TTFT or a TPOT bound")

    def met_by(self, m: RequestMetrics) -> bool:
        if m.finish_reason not in ("stop", "length"):
            return False
        if self.ttft_s is not None and (m.ttft is None or m.ttft > self.ttft_s):
            return False
        tpot = m.tpot
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s


def slo_attainment(result: SimResult, slo: SLO, num_requests: int) -> float:
    met = sum(1 for m in result.finished.values() if slo.met_by(m))
    return met / num_requests if num_requests else 1.0


@dataclass
class Probe:
    value: float  # replicas or requests/s per replica
    attainment: float  # lower bound if the run stopped early
    meets: bool
    stopped_early: bool
    wall_s: float
    # The whole run, kept while it is the best one that meets the SLO (it ran to the end).
    result: SimResult | None = field(default=None, repr=False, compare=False)


@dataclass
class CapacityResult:
    value: float | None  # None: no probe within the bounds met the SLO
    # The nearest probed value that misses (one replica fewer, or the lowest failing
    # rate); None if every probe met the SLO (the capacity is not bracketed).
    failing: float | None
    probes: list[Probe]

    @property
    def result(self) -> SimResult | None:
        """The simulated run at ``value`` (the workload as it would be served there)."""
        return next((p.result for p in self.probes if p.meets and p.value == self.value),
                    None)


def run_probe(sim: Simulator, requests: Sequence[WorkloadRequest], slo: SLO,
              value: float) -> Probe:
    n = len(requests)
    allowed_misses = n - slo.attainment * n
    misses = 0

    def on_finished(rid: str, m: RequestMetrics | None) -> bool:
        nonlocal misses
        if m is None or not slo.met_by(m):
            misses += 1
        return misses > allowed_misses

    result = sim.run(requests, on_finished=on_finished)
    att = slo_attainment(result, slo, n)
    meets = att >= slo.attainment and not result.stopped_early
    return Probe(value, att, meets, result.stopped_early, result.wall_s,
                 result if meets else None)


def _keep_best(probes: list[Probe], best: Callable[[Probe, Probe], bool]) -> None:
    """Drop the run of every meeting probe but the best (runs hold every request)."""
    meeting = [p for p in probes if p.result is not None]
    for p in meeting:
        if any(best(q, p) for q in meeting if q is not p):
            p.result = None


def find_min_replicas(requests: Sequence[WorkloadRequest], engine_args: EngineArgs,
                      cost: MachineCostModel, slo: SLO, *, router: str = "least_loaded",
                      max_replicas: int = 64,
                      log: Callable[[Probe], None] | None = None) -> CapacityResult:
    """The fewest replicas (at most ``max_replicas``) whose attainment meets ``slo``."""
    probes: list[Probe] = []

    def meets(n: int) -> bool:
        probe = run_probe(Simulator(engine_args, cost, replicas=n, router=router), requests,
                          slo, n)
        probes.append(probe)
        _keep_best(probes, lambda a, b: a.value < b.value)
        if log:
            log(probe)
        return probe.meets

    lo, hi, n = 0, None, 1  # lo: largest count known to miss; hi: smallest known to meet
    while n <= max_replicas:
        if meets(n):
            hi = n
            break
        lo = n
        n = min(n * 2, max_replicas) if n < max_replicas else max_replicas + 1
    if hi is None:
        return CapacityResult(None, lo or None, probes)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid
    return CapacityResult(hi, lo or None, probes)


def at_rate(requests: Sequence[WorkloadRequest], rate: float) -> list[BenchRequest]:
    """The same requests and order with arrival gaps scaled to a mean of ``rate`` req/s."""
    from conveyor.bench.workload import BenchRequest  # numpy: only when a rate is searched

    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    times = sorted(r.arrival_s for r in requests)
    span = times[-1] - times[0] if times else 0.0
    if len(times) < 2 or span <= 0:
        raise ValueError("rescaling the rate needs at least two distinct arrival times")
    factor = (len(times) - 1) / span / rate
    t0 = times[0]
    return [BenchRequest(r.request_id, t0 + (r.arrival_s - t0) * factor, r.prompt_token_ids,
                         r.output_len, r.tenant, r.priority, r.slo_ttft_ms, r.slo_tpot_ms)
            for r in requests]


def find_max_rate(requests: Sequence[WorkloadRequest], engine_args: EngineArgs,
                  cost: MachineCostModel, slo: SLO, *, replicas: int = 1,
                  router: str = "least_loaded", rel_tol: float = 0.02, max_probes: int = 24,
                  log: Callable[[Probe], None] | None = None) -> CapacityResult:
    """The highest request rate per replica (req/s) at which ``slo`` is met.

    The workload's arrival pattern is kept and stretched or compressed in time;
    the search stops when the bracket is within ``rel_tol``.
    """
    probes: list[Probe] = []
    sim = Simulator(engine_args, cost, replicas=replicas, router=router)

    def meets(rate: float) -> bool:
        probe = run_probe(sim, at_rate(requests, rate * replicas), slo, rate)
        probes.append(probe)
        _keep_best(probes, lambda a, b: a.value > b.value)
        if log:
            log(probe)
        return probe.meets

    times = sorted(r.arrival_s for r in requests)
    rate = (len(times) - 1) / max(times[-1] - times[0], 1e-9) / replicas
    lo = hi = None  # lo: highest rate known to meet; hi: lowest known to miss
    while len(probes) < max_probes and (lo is None or hi is None):
        if meets(rate):
            lo = rate
            rate *= 2
        else:
            hi = rate
            rate /= 2
    while lo is not None and hi is not None and hi / lo - 1 > rel_tol \
            and len(probes) < max_probes:
        mid = (lo * hi) ** 0.5
        if meets(mid):
            lo = mid
        else:
            hi = mid
    return CapacityResult(lo, hi, probes)
