"""Replay a workload through an in-process ``LLMEngine`` in real time (no HTTP).

Each request is added once its arrival time has passed, stamped with that arrival
time (a request that arrives while a step runs has been waiting since it arrived),
and the engine is stepped while anything is unfinished. Output lengths are forced
with ``ignore_eos`` so every system generates the same tokens.

Time is the engine's clock (monotonic wall time), or, given a ``StepCostModel``, a
virtual clock that each step moves by its modelled cost (``bench/model_clock.py``):
a deterministic replay for comparing schedulers on a machine too busy to time them.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from conveyor.bench.metrics import RequestRecord, RunResult, summarize
from conveyor.bench.model_clock import ModelClock, ModelClockExecutor
from conveyor.bench.workload import BenchRequest
from conveyor.config import EngineArgs
from conveyor.costs.protocol import StepCostModel
from conveyor.sampling_params import SamplingParams


def forced_params(req: BenchRequest) -> SamplingParams:
    """Greedy, exactly ``output_len`` tokens, no detokenizing (the bench needs no text)."""
    return SamplingParams(max_tokens=req.output_len, ignore_eos=True, temperature=0.0,
                          detokenize=False)


FollowUp = Callable[[BenchRequest, list[int], float], "BenchRequest | None"]


def run_engine(requests: list[BenchRequest], engine_args: EngineArgs | None = None, *,
               engine=None, label: str = "engine", progress: bool = True,
               follow_up: FollowUp | None = None,
               cost_model: StepCostModel | None = None,
               sleep: Callable[[float], None] = time.sleep) -> RunResult:
    """Run ``requests`` to completion on ``engine`` (built from ``engine_args`` if None);
    with ``cost_model`` (any ``StepCostModel``), in virtual time
    (an engine passed in gets its clock back).

    The result's records follow ``requests``, then follow-ups in the order they were made.
    ``sleep(seconds)`` waits for the next arrival when the engine is idle; an engine on a
    clock of its own (not the wall clock) passes one that advances that clock.
    """
    from tqdm import tqdm

    from conveyor.engine.llm_engine import LLMEngine, QueueFullError

    if engine is None:
        engine = LLMEngine(engine_args or EngineArgs())
    core = engine.core
    own_clock, own_executor = core.clock, core.executor
    if cost_model is not None:
        core.clock = ModelClock()
        core.executor = ModelClockExecutor(own_executor, core.clock, cost_model)
    pending = sorted(requests, key=lambda r: r.arrival_s)
    by_id = {r.request_id: r for r in pending}
    issued = list(requests)
    records: dict[str, RequestRecord] = {}
    tracer = _StepTracer(engine)
    bar = tqdm(total=len(pending), desc=label, unit="req", disable=not progress, leave=False)
    clock = core.clock
    virtual = isinstance(clock, ModelClock)
    t0 = clock()
    nxt = 0
    try:
        while nxt < len(pending) or engine.has_unfinished_requests():
            now = clock() - t0
            while nxt < len(pending) and pending[nxt].arrival_s <= now:
                req = pending[nxt]
                nxt += 1
                try:
                    engine.add_request(req.prompt_token_ids, forced_params(req),
                                       request_id=req.request_id,
                                       arrival_time=t0 + req.arrival_s,
                                       priority=req.priority, tenant=req.tenant,
                                       slo_ttft_ms=req.slo_ttft_ms,
                                       slo_tpot_ms=req.slo_tpot_ms)
                except (ValueError, QueueFullError) as e:
                    kind = "rejected" if isinstance(e, QueueFullError) else "invalid"
                    records[req.request_id] = RequestRecord.failed(req, f"{kind}: {e}")
                    bar.update(1)
            if engine.has_unfinished_requests():
                t_step = clock()
                outputs = engine.step()
                tracer.record(clock() - t_step)
                for out in outputs:
                    if out.finished and out.metrics is not None:
                        req = by_id[out.request_id]
                        records[req.request_id] = RequestRecord.from_metrics(
                            req, out.metrics, t0)
                        bar.update(1)
                        if follow_up is not None:
                            nxt_req = follow_up(req, out.outputs[0].token_ids,
                                                out.metrics.finished_time - t0)
                            if nxt_req is not None:
                                _insert(pending, nxt, nxt_req, by_id)
                                issued.append(nxt_req)
                                bar.total += 1
            elif virtual:  # idle: jump to the next arrival
                clock.advance_to(t0 + pending[nxt].arrival_s)
            elif nxt < len(pending):
                sleep(max(0.0, pending[nxt].arrival_s - (clock() - t0)))
        duration = clock() - t0
    finally:
        bar.close()
        core.clock, core.executor = own_clock, own_executor
    stats = engine.stats()
    sizes = [rows for rows, _, _ in tracer.trace]
    ordered = [records[r.request_id] for r in issued]
    summary = summarize(
        ordered, duration, num_preemptions=stats["num_preemptions"],
        peak_kv_usage=stats["peak_kv_blocks"] / max(stats["num_kv_blocks"], 1),
        extra={"backend": "engine", "num_steps": stats["num_steps"],
               "mean_batch_size": sum(sizes) / len(sizes) if sizes else 0.0,
               "num_kv_blocks": stats["num_kv_blocks"],
               "batching": engine.config.scheduler.batching,
               "max_num_seqs": engine.config.scheduler.max_num_seqs,
               "model": engine.config.model.served_model_name,
               "dtype": engine.config.model.dtype_label,
               "num_slo_rejected": stats["num_slo_rejected"],
               "token_budget": stats["token_budget"], **spec_figures(stats)})
    return RunResult(label, ordered, summary, sizes, tracer.trace)


def spec_figures(stats: dict) -> dict:
    """Speculative decoding's figures for a summary's ``extra`` (none when it is off)."""
    spec = stats.get("spec_decode")
    if not spec:
        return {}
    return {"spec_method": spec["method"],
            "spec_draft_tokens": spec["num_draft_tokens"],
            "spec_acceptance_rate": spec["acceptance_rate"],
            "spec_mean_acceptance_length": spec["mean_acceptance_length"],
            "spec_acceptance_per_position": spec["acceptance_rate_per_position"]}


def _insert(pending: list[BenchRequest], start: int, req: BenchRequest,
            by_id: dict[str, BenchRequest]) -> None:
    """Queue a follow-up among the requests not yet added, in arrival order."""
    if req.request_id in by_id:
        raise ValueError(f"follow-up request id {req.request_id!r} is already in use")
    by_id[req.request_id] = req
    keys = [r.arrival_s for r in pending[start:]]
    pending.insert(start + bisect.bisect_right(keys, req.arrival_s), req)


class _StepTracer:
    """(requests, tokens, seconds) of every step that ran a batch, from the scheduler's
    counters: the engine's own stats stay the single source of what a step held."""

    def __init__(self, engine) -> None:
        self.stats = engine.scheduler.stats
        self.trace: list[tuple[int, int, float]] = []
        self._steps = self.stats.num_steps
        self._tokens = self.stats.total_scheduled_tokens

    def record(self, seconds: float) -> None:
        if self.stats.num_steps > self._steps:
            tokens = self.stats.total_scheduled_tokens - self._tokens
            self.trace.append((self.stats.last_step_batch_size, tokens, seconds))
        self._steps = self.stats.num_steps
        self._tokens = self.stats.total_scheduled_tokens
