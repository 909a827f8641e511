"""Prometheus metrics (prefix ``conveyor:``) from the engine's own per-request figures.

Two sources, so that the numbers on ``/metrics`` are the numbers in the engine:

- Per-request histograms and the finished-by-reason counter are fed with the
  ``RequestMetrics`` of requests as they finish (the same objects the engine keeps
  in ``finished_metrics`` for the benchmark harness).
- Gauges and token/preemption/rejection counters are read from ``engine.stats()``
  at scrape time, so they are exact even while the engine sits idle.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from conveyor.outputs import RequestMetrics

PREFIX = "conveyor:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,
                          0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


def token_buckets(max_len: int) -> tuple[float, ...]:
    """1-2-5 steps up to ``max_len`` tokens (the last bucket is ``max_len`` itself)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale >= max_len:
                return (*out, float(max_len))
            out.append(float(m * scale))
        scale *= 10


# engine.stats() key -> (metric name, help); counters are cumulative since start.
_STAT_COUNTERS = {
    "prompt_tokens": ("prompt_tokens", "Prompt tokens processed (prefilled)."),
    "generation_tokens": ("generation_tokens", "Tokens generated."),
    "num_preemptions": ("num_preemptions", "Requests preempted (recomputed later)."),
    "num_rejected": ("num_requests_rejected",
                     "Requests rejected by admission control (queue full or waited too long)."),
    "prefix_cache_queries": ("prefix_cache_queries",
                             "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "num_step_errors": ("engine_step_errors",
                        "Engine steps that raised (the requests in flight failed)."),
    "num_slo_rejected": ("num_requests_slo_rejected",
                         "Requests rejected early: their TTFT target could no longer be met "
                         "(--scheduling-policy slo --slo-late-action reject)."),
}
_STAT_GAUGES = {
    "num_running": ("num_requests_running", "Requests in the running batch."),
    "num_waiting": ("num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_usage": ("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)."),
    "num_kv_blocks": ("kv_cache_total_blocks", "KV blocks in the pool."),
    "num_free_kv_blocks": ("kv_cache_free_blocks",
                           "KV blocks that can be handed out now (free plus evictable)."),
    "cached_blocks": ("kv_cache_cached_blocks", "KV blocks findable in the prefix cache."),
    "evictable_blocks": ("kv_cache_evictable_blocks",
                         "Cached KV blocks no request holds (reusable, evicted on demand)."),
    "prefix_cache_hit_rate": ("prefix_cache_hit_rate",
                              "Prefix-cache hits over queries, in tokens, since start."),
}


class _EngineStatsCollector(Collector):
    """Exposes the latest ``engine.stats()`` snapshot as gauges and counters."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        for key, (name, doc) in _STAT_COUNTERS.items():
            if key in stats:
                c = CounterMetricFamily(PREFIX + name, doc)
                c.add_metric([], float(stats[key]))
                yield c
        for key, (name, doc) in _STAT_GAUGES.items():
            if key in stats:
                yield GaugeMetricFamily(PREFIX + name, doc, value=float(stats[key]))
        budget = stats.get("token_budget") or {}
        if budget.get("mode") == "slo":
            # The chosen per-step token budget (buckets in tokens; cumulative counts).
            buckets, total = [], 0
            for bound, count in sorted((int(b), c) for b, c in budget["histogram"].items()):
                total += count
                buckets.append((str(bound), total))
            buckets[-1] = ("+Inf", total)
            yield HistogramMetricFamily(
                PREFIX + "step_token_budget", "The SLO controller's token budget per step "
                "(what a step scheduled when TPOT targets bound it, else the ceiling).",
                buckets=buckets, sum_value=float(budget.get("histogram_sum", 0)))
        spec = stats.get("spec_decode")
        if spec:
            yield from _spec_metrics(spec)
        if "prompt_tokens_computed" in stats:
            c = CounterMetricFamily(PREFIX + "prompt_tokens_computed",
                                    "Prompt positions this engine computed (not prefix-cache "
                                    "hits, not K/V pulled from a prefill engine).")
            c.add_metric([], float(stats["prompt_tokens_computed"]))
            yield c
        kv = stats.get("kv_transfer")
        if kv:
            yield from _kv_transfer_metrics(kv)


# kv_transfer stats key -> (metric name, help): prefill/decode disaggregation.
_KV_COUNTERS = {
    "bytes_sent": ("kv_transfer_bytes_sent", "K/V payload bytes served to decode engines."),
    "bytes_received": ("kv_transfer_bytes_received",
                       "K/V payload bytes pulled from prefill engines and written here."),
    "blocks_sent": ("kv_transfer_blocks_sent", "KV blocks served to decode engines."),
    "blocks_received": ("kv_transfer_blocks_received", "KV blocks filled from a prefill."),
    "loads_ok": ("kv_transfer_loads", "Loads (decode side) written into the cache."),
    "loads_failed": ("kv_transfer_failed",
                     "Loads (decode side) that failed: peer gone, timeout, refused."),
    "leases_granted": ("kv_transfer_leases_granted",
                       "Finished requests whose blocks went under a lease (prefill side)."),
    "leases_released": ("kv_transfer_leases_released",
                        "Leases ended by the decode engine's done (prefill side)."),
    "leases_expired": ("kv_transfer_leases_expired",
                       "Leases ended by their timeout (prefill side)."),
    "requests_recomputed": ("kv_transfer_requests_recomputed",
                            "Requests whose prompt was computed here after a failed load."),
    "requests_failed": ("kv_transfer_requests_failed",
                        "Requests failed after a failed load (--kv-transfer-fallback fail)."),
}
_KV_GAUGES = {
    "leases_held": ("kv_transfer_leases_held", "Leases held for decode engines now."),
    "loads_in_flight": ("kv_transfer_loads_in_flight", "Loads in flight now."),
}


def _kv_transfer_metrics(kv: dict[str, Any]) -> Iterator[Metric]:
    for key, (name, doc) in _KV_COUNTERS.items():
        c = CounterMetricFamily(PREFIX + name, doc)
        c.add_metric([], float(kv[key]))
        yield c
    for key, (name, doc) in _KV_GAUGES.items():
        yield GaugeMetricFamily(PREFIX + name, doc, value=float(kv[key]))
    lat = kv["latency_s"]
    buckets, total = [], 0
    for bound, count in zip([*lat["buckets"], "+Inf"], lat["counts"]):
        total += count
        buckets.append((str(bound), total))
    yield HistogramMetricFamily(
        PREFIX + "kv_transfer_latency_seconds",
        "Decode side: from ordering a load to its bytes in the cache; prefill side: from "
        "granting a lease to the decode engine's done.",
        buckets=buckets, sum_value=float(lat["sum"]))


# spec_decode stats key -> (metric name, help); vLLM's names, labelled by method.
_SPEC_COUNTERS = {
    "num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens verified."),
    "num_accepted_tokens": ("spec_decode_num_accepted_tokens",
                            "Draft tokens accepted (per position, up to the first rejection)."),
    "num_verify_steps": ("spec_decode_num_drafts",
                         "Verifications: (request, step) pairs with at least one draft."),
    "num_proposed_tokens": ("spec_decode_num_proposed_tokens",
                            "Draft tokens the proposer returned (some unused by the controller)."),
}


def _spec_metrics(spec: dict[str, Any]) -> Iterator[Metric]:
    method = [spec["method"]]
    for key, (name, doc) in _SPEC_COUNTERS.items():
        c = CounterMetricFamily(PREFIX + name, doc, labels=["method"])
        c.add_metric(method, float(spec[key]))
        yield c
    per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted at each position.",
                                  labels=["method", "position"])
    for pos, n in enumerate(spec["accepted_per_position"]):
        per_pos.add_metric([spec["method"], str(pos)], float(n))
    yield per_pos
    yield GaugeMetricFamily(PREFIX + "spec_decode_mean_acceptance_length",
                            "Tokens per verifying step, the bonus token included.",
                            value=float(spec["mean_acceptance_length"]))


class EngineMetrics:
    """A registry of conveyor metrics; one per served engine."""

    def __init__(self, max_model_len: int = 1 << 17,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Time from arrival to the first generated token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds",
                             "Time between consecutive generated tokens.",
                             buckets=_TOKEN_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "Time from arrival to finish.", buckets=_LATENCY_BUCKETS,
                             registry=r)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds",
                                    "Time from arrival to first being scheduled.",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        tokens = token_buckets(max_model_len)
        self.prompt_len = Histogram(PREFIX + "request_prompt_tokens",
                                    "Prompt length of finished requests.", buckets=tokens,
                                    registry=r)
        self.generation_len = Histogram(PREFIX + "request_generation_tokens",
                                        "Generated length of finished requests.",
                                        buckets=tokens, registry=r)
        self.finished = Counter(PREFIX + "request_success",
                                "Finished requests (sequences), by finish reason.",
                                ["finished_reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self.finished.labels(reason)
        self.slo = Counter(PREFIX + "request_slo",
                           "Finished requests with a TTFT or TPOT target, by target and "
                           "whether they met it (attainment = met / all, goodput = the rate "
                           "of requests meeting both).", ["target", "result"], registry=r)
        self._stats = _EngineStatsCollector()
        r.register(self._stats)

    def observe_finished(self, finished: Iterable[RequestMetrics]) -> None:
        """Record requests that just finished (thread-safe)."""
        for m in finished:
            self.finished.labels(m.finish_reason or "abort").inc()
            self.prompt_len.observe(m.num_prompt_tokens)
            self.generation_len.observe(m.num_generation_tokens)
            if m.ttft is not None:
                self.ttft.observe(m.ttft)
            if m.tpot is not None:
                self.tpot.observe(m.tpot)
            if m.e2e_latency is not None:
                self.e2e.observe(m.e2e_latency)
            if m.queue_time is not None:
                self.queue_time.observe(m.queue_time)
            for gap in m.itls:
                self.itl.observe(gap)
            completed = m.finish_reason in ("stop", "length")
            if m.slo_ttft_s is not None:
                met = completed and m.ttft is not None and m.ttft <= m.slo_ttft_s
                self.slo.labels("ttft", "met" if met else "missed").inc()
            if m.slo_tpot_s is not None:
                met = completed and (m.tpot is None or m.tpot <= m.slo_tpot_s)
                self.slo.labels("tpot", "met" if met else "missed").inc()
            if m.slo_attained is not None:
                self.slo.labels("both", "met" if m.slo_attained else "missed").inc()

    def update_stats(self, stats: dict[str, Any]) -> None:
        self._stats.stats = dict(stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)
