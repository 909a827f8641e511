"""Prefix caching off against on: run a workload both ways and measure what was saved.

    run = run_cache_mode(make_requests, engine_args, caching=True)  # one fresh engine
    run.hit_rate, run.prefill_tokens, run.summary.latency["ttft"], run.sequences
    proportionality(off, on)     # TTFT saved relative to prefill saved

``make_requests()`` returns (first requests, follow_up or None) and is called once per
run, so a closed-loop workload starts afresh each time. The prefill work of a run is
counted from the scheduler: every scheduled token is a prompt token computed (a cache
miss, or a recompute after preemption) or a decode input, and a request feeds back
all its generated tokens but the last.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from conveyor.bench.engine_backend import FollowUp, run_engine
from conveyor.bench.metrics import Summary
from conveyor.bench.workload import BenchRequest
from conveyor.config import EngineArgs
from conveyor.costs.linear import LinearStepCost

MakeRequests = Callable[[], tuple[list[BenchRequest], FollowUp | None]]


@dataclass
class CacheRun:
    label: str
    summary: Summary
    queries: int  # prompt tokens looked up (each prompt once)
    hits: int  # of which found cached
    prefill_tokens: int  # prompt tokens computed, recomputes after preemption included
    prompt_tokens: int
    num_preemptions: int
    num_evictions: int
    num_kv_blocks: int
    policy_stats: dict = field(default_factory=dict)
    # (prompt ids, generated ids) of every request in arrival order, for the ideal,
    # and their request ids.
    sequences: list[tuple[list[int], list[int]]] = field(default_factory=list, repr=False)
    request_ids: list[str] = field(default_factory=list, repr=False)
    # (requests, tokens, seconds) of each engine step
    step_trace: list[tuple[int, int, float]] = field(default_factory=list, repr=False)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def by_id(self) -> dict[str, tuple[list[int], list[int]]]:
        return dict(zip(self.request_ids, self.sequences))

    def ttft_ms(self, stat: str) -> float:
        return getattr(self.summary.latency["ttft"], stat)


def run_cache_mode(make_requests: MakeRequests, engine_args: EngineArgs, *, caching: bool,
                   label: str | None = None, progress: bool = False) -> CacheRun:
    """One run on a fresh engine with prefix caching on or off."""
    from conveyor.engine.llm_engine import LLMEngine

    args = dataclasses.replace(engine_args, enable_prefix_caching=caching)
    engine = LLMEngine(args)
    requests, follow_up = make_requests()
    issued = {r.request_id: r for r in requests}
    outputs: dict[str, list[int]] = {}

    def observe(req: BenchRequest, output_ids: list[int], finished_s: float):
        outputs[req.request_id] = list(output_ids)
        nxt = follow_up(req, output_ids, finished_s) if follow_up is not None else None
        if nxt is not None:
            issued[nxt.request_id] = nxt
        return nxt

    label = label or ("on" if caching else "off")
    result = run_engine(requests, engine=engine, label=label, progress=progress,
                        follow_up=observe)
    stats = engine.stats()
    fed_back = sum(max(r.output_tokens - 1, 0) for r in result.records)
    by_arrival = sorted(result.records, key=lambda r: r.arrival_s)
    return CacheRun(
        label=label, summary=result.summary, queries=stats["prefix_cache_queries"],
        hits=stats["prefix_cache_hits"], prefill_tokens=stats["scheduled_tokens"] - fed_back,
        prompt_tokens=sum(r.prompt_tokens for r in result.records),
        num_preemptions=stats["num_preemptions"], num_evictions=engine.kv.pool.num_evictions,
        num_kv_blocks=stats["num_kv_blocks"], policy_stats=stats["policy"],
        sequences=[(issued[r.request_id].prompt_token_ids, outputs.get(r.request_id, []))
                   for r in by_arrival],
        request_ids=[r.request_id for r in by_arrival],
        step_trace=result.step_trace)


@dataclass
class Proportionality:
    """Whether TTFT fell in proportion to the prefill saved.

    A cached prompt token is one token less in the step that prefills its request, so
    it should take the marginal cost of a scheduled token (``per_token_s``, fitted on
    the caching-off run's steps) off that request's TTFT: the *expected* mean saving
    is that cost times the prompt tokens saved per request. ``ratio`` = measured mean
    TTFT saving / expected: about 1 when TTFT falls in proportion, above 1 when the
    work no longer done also shortens queues, below 1 when hits do not reach the
    requests waiting for a first token. The fixed part of a step (scheduling, other
    requests' decodes) is not saved, which is why TTFT falls by a smaller fraction
    than prefill tokens do.
    """

    prefill_saved: float  # 1 - prefill tokens on / off
    saved_tokens_per_request: float
    per_token_s: float | None  # None: the off run's steps gave nothing to fit
    fixed_s: float | None
    ttft_saved_ms: dict[str, float]  # TTFT statistic -> off - on, milliseconds
    ttft_saved: dict[str, float]  # TTFT statistic -> 1 - on / off

    @property
    def expected_ms(self) -> float | None:
        if self.per_token_s is None:
            return None
        return 1e3 * self.per_token_s * self.saved_tokens_per_request

    def ratio(self) -> float | None:
        """Measured over expected mean TTFT saving; None when nothing was expected."""
        expected = self.expected_ms
        if expected is None or expected <= 0:
            return None
        return self.ttft_saved_ms["mean"] / expected


def proportionality(off: CacheRun, on: CacheRun,
                    stats: tuple[str, ...] = ("mean", "median", "p99")) -> Proportionality:
    """``off`` and ``on`` must have replayed the same requests."""
    saved = off.prefill_tokens - on.prefill_tokens
    cost = fit_step_cost(off.step_trace)
    return Proportionality(
        prefill_saved=saved / off.prefill_tokens if off.prefill_tokens else 0.0,
        saved_tokens_per_request=saved / max(off.summary.num_completed, 1),
        per_token_s=cost[1] if cost else None, fixed_s=cost[0] if cost else None,
        ttft_saved_ms={s: off.ttft_ms(s) - on.ttft_ms(s) for s in stats},
        ttft_saved={s: 1 - on.ttft_ms(s) / off.ttft_ms(s) for s in stats})


def fit_step_cost(trace: list[tuple[int, int, float]]) -> tuple[float, float] | None:
    """(fixed, per-token) seconds of an engine step, from the model-clock fit over
    ``(requests, tokens, seconds)`` steps; None when step sizes do not vary (nothing to
    fit). The fixed part includes the per-request term at the mean batch size."""
    if len(trace) < 3 or len({tokens for _, tokens, _ in trace}) < 2:
        return None
    model = LinearStepCost.fit(trace)
    mean_requests = sum(r for r, _, _ in trace) / len(trace)
    return model.base_s + model.per_seq_s * mean_requests, model.per_token_s
