"""Per-request records and the run summary (throughput, latency percentiles, goodput).

Everything here is plain arithmetic on ``RequestRecord``s, which are built from
``conveyor.outputs.RequestMetrics``: the engine fills those itself, the HTTP client
fills them from the stream, and the simulator can fill them from its virtual clock.

Conventions (as in vLLM's benchmark): TTFT is first token minus arrival; TPOT is
(last token - first token) / (output tokens - 1) per request; ITLs are pooled over all
requests; percentiles interpolate linearly between order statistics; goodput counts
completed requests that meet every SLO they carry (TPOT is met trivially by a
one-token output), per second of run.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from conveyor.bench.workload import BenchRequest
from conveyor.outputs import RequestMetrics

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e", "queue")
PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestRecord:
    request_id: str
    arrival_s: float  # on the run's clock: seconds after the run started
    tenant: str
    priority: int
    prompt_tokens: int
    output_tokens: int  # generated
    expected_output_tokens: int  # what the workload asked for
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    queue_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    @property
    def ok(self) -> bool:
        """Completed: no error, not aborted, and at least one token came back."""
        return self.error is None and self.finish_reason not in ("abort", None) \
            and self.output_tokens > 0

    @property
    def meets_slo(self) -> bool:
        return self.meets_ttft and self.meets_tpot

    @property
    def meets_ttft(self) -> bool:
        """Completed within its TTFT target (or carries none)."""
        return self.ok and not (self.slo_ttft_ms is not None and (
            self.ttft_s is None or self.ttft_s * 1e3 > self.slo_ttft_ms))

    @property
    def meets_tpot(self) -> bool:
        """Completed within its TPOT target (or carries none; one token meets it)."""
        return self.ok and not (self.slo_tpot_ms is not None and self.tpot_s is not None
                                and self.tpot_s * 1e3 > self.slo_tpot_ms)

    @classmethod
    def from_metrics(cls, req: BenchRequest, m: RequestMetrics, t0: float) -> RequestRecord:
        """``t0`` is the run's start on the clock ``m`` was measured with."""
        return cls(
            request_id=req.request_id, arrival_s=m.arrival_time - t0, tenant=req.tenant,
            priority=req.priority, prompt_tokens=m.num_prompt_tokens or req.prompt_len,
            output_tokens=m.num_generation_tokens, expected_output_tokens=req.output_len,
            ttft_s=m.ttft, tpot_s=m.tpot, e2e_s=m.e2e_latency, queue_s=m.queue_time,
            itls_s=m.itls, num_preemptions=m.num_preemptions,
            num_cached_tokens=m.num_cached_tokens, finish_reason=m.finish_reason,
            slo_ttft_ms=req.slo_ttft_ms, slo_tpot_ms=req.slo_tpot_ms)

    @classmethod
    def failed(cls, req: BenchRequest, error: str, arrival_s: float | None = None
               ) -> RequestRecord:
        return cls(req.request_id, req.arrival_s if arrival_s is None else arrival_s,
                   req.tenant, req.priority, req.prompt_len, 0, req.output_len,
                   error=error, slo_ttft_ms=req.slo_ttft_ms, slo_tpot_ms=req.slo_tpot_ms)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def records_from_metrics(requests: list[BenchRequest], metrics: dict[str, RequestMetrics],
                         t0: float = 0.0) -> list[RequestRecord]:
    """Records in workload order from ``request_id -> RequestMetrics`` (e.g. a simulator's);
    a request without metrics is recorded as failed ("no result")."""
    return [RequestRecord.from_metrics(r, metrics[r.request_id], t0)
            if r.request_id in metrics else RequestRecord.failed(r, "no result")
            for r in requests]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default); NaN if empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class LatencyStats:
    """Milliseconds."""

    mean: float
    median: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of(cls, seconds: list[float]) -> LatencyStats:
        ms = [s * 1e3 for s in seconds]
        mean = statistics.fmean(ms) if ms else math.nan
        p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
        return cls(mean, p50, p90, p99, len(ms))


@dataclass
class Summary:
    num_requests: int
    num_completed: int
    num_failed: int
    duration_s: float
    request_throughput: float  # completed requests/s
    input_throughput: float  # prompt tokens/s of completed requests
    output_throughput: float  # generated tokens/s
    total_token_throughput: float
    total_input_tokens: int
    total_output_tokens: int
    latency: dict[str, LatencyStats]
    goodput: float | None  # requests/s meeting their SLOs; None when none carries an SLO
    slo_attainment: float | None  # share of all requests meeting their SLOs
    num_preemptions: int | None  # None when the backend can't see them
    peak_kv_usage: float | None  # fraction of the KV pool; None when the backend can't see it
    extra: dict[str, Any] = field(default_factory=dict)
    # Shares of all requests that completed within the TTFT (TPOT) target they carry;
    # None when no request carries one.
    ttft_attainment: float | None = None
    tpot_attainment: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["latency"] = {k: asdict(v) for k, v in self.latency.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Summary:
        d = dict(d)
        d["latency"] = {k: LatencyStats(**v) for k, v in d["latency"].items()}
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def summarize(records: list[RequestRecord], duration_s: float, *,
              num_preemptions: int | None = None, peak_kv_usage: float | None = None,
              extra: dict[str, Any] | None = None) -> Summary:
    """The run's figures; ``duration_s`` runs from the run's start to its last finish."""
    done = [r for r in records if r.ok]
    duration = duration_s if duration_s > 0 else math.nan
    inp = sum(r.prompt_tokens for r in done)
    out = sum(r.output_tokens for r in done)
    samples = {
        "ttft": [r.ttft_s for r in done if r.ttft_s is not None],
        "tpot": [r.tpot_s for r in done if r.tpot_s is not None],
        "itl": [x for r in done for x in r.itls_s],
        "e2e": [r.e2e_s for r in done if r.e2e_s is not None],
        "queue": [r.queue_s for r in done if r.queue_s is not None],
    }
    has_slo = any(r.slo_ttft_ms is not None or r.slo_tpot_ms is not None for r in records)
    good = sum(r.meets_slo for r in records)
    return Summary(
        num_requests=len(records), num_completed=len(done),
        num_failed=len(records) - len(done), duration_s=duration_s,
        request_throughput=len(done) / duration, input_throughput=inp / duration,
        output_throughput=out / duration, total_token_throughput=(inp + out) / duration,
        total_input_tokens=inp, total_output_tokens=out,
        latency={k: LatencyStats.of(v) for k, v in samples.items()},
        goodput=good / duration if has_slo else None,
        slo_attainment=good / len(records) if has_slo and records else None,
        num_preemptions=(num_preemptions if num_preemptions is not None
                         else sum(r.num_preemptions for r in records)),
        peak_kv_usage=peak_kv_usage, extra=dict(extra or {}),
        ttft_attainment=_share(records, "meets_ttft", "slo_ttft_ms"),
        tpot_attainment=_share(records, "meets_tpot", "slo_tpot_ms"))


def _share(records: list[RequestRecord], test: str, target: str) -> float | None:
    if not records or all(getattr(r, target) is None for r in records):
        return None
    return sum(getattr(r, test) for r in records) / len(records)


@dataclass
class RunResult:
    """One replay of a workload: its records, its summary, and the backend's step trace."""

    label: str
    records: list[RequestRecord]
    summary: Summary
    # Requests in each engine step (engine backend only), for slot and cost analysis.
    step_batch_sizes: list[int] = field(default_factory=list)
    # (requests, tokens, seconds) of each engine step, timed around engine.step().
    step_trace: list[tuple[int, int, float]] = field(default_factory=list)
