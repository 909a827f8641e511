"""One simulated engine replica: conveyor's own Scheduler and KVCacheManager, no runner.

A step is what ``LLMEngine.step`` does with the runner replaced by the cost model:

    out = scheduler.schedule(start)                   # the real scheduler decides
    end = start + cost.step_time(batch_shape(out))    # the cost model says how long
    scheduler.update(out, <one fake token per sampling request>, end)

The fake token is never an end-of-sequence token: requests run to ``max_tokens``
(their trace output length, with ``ignore_eos``), as a benchmark with a real model
forces them to. Per-request ``RequestMetrics`` are filled by the same methods the
engine's output processor uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from conveyor.config import CacheConfig, ModelConfig, SchedulerConfig
from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.core.scheduler import Scheduler
from conveyor.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from conveyor.engine.validation import (
    capped_max_tokens,
    validate_prompt,
    validate_scheduling,
)
from conveyor.outputs import RequestMetrics
from conveyor.request import Request, RequestStatus
from conveyor.sampling_params import SamplingParams
from conveyor.sim.batch import batch_shape
from conveyor.sim.cost_model import CostModel


class QueueFull(ValueError):
    """Admission control refused a request (the engine's QueueFullError)."""


class WorkloadRequest(Protocol):
    """What the simulator reads of a workload request (the bench workload dataclass)."""

    request_id: str
    arrival_s: float
    prompt_token_ids: list[int]
    output_len: int
    tenant: str
    priority: int
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None


RUNNING = RequestStatus.RUNNING  # a module constant: enum member lookups are slow

# Listener called after every step: (replica index, start, end, the step's SchedulerOutput).
StepListener = Callable[[int, float, float, SchedulerOutput], None]


@dataclass(frozen=True)
class ReplicaSetup:
    """What every replica shares, resolved once like the engine's derived config."""

    model: ModelConfig  # max_model_len already capped by the KV pool
    cache: CacheConfig  # num_kv_blocks resolved
    scheduler: SchedulerConfig
    fake_token: int  # the token every step "samples": in the vocabulary, never an EOS
    kv_hash_key: bytes

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len


def default_params(item: WorkloadRequest, eos_token_ids: frozenset[int]) -> SamplingParams:
    """Run to the trace's output length: greedy, ``max_tokens=output_len``, ``ignore_eos``."""
    return SamplingParams(max_tokens=item.output_len, temperature=0.0, ignore_eos=True,
                          eos_token_ids=eos_token_ids)


class SimReplica:
    def __init__(self, index: int, setup: ReplicaSetup, cost: CostModel,
                 make_params: Callable[[WorkloadRequest], SamplingParams],
                 listeners: list[StepListener], pool_blocks: int | None = None) -> None:
        self.index = index
        self.setup = setup
        self.cost = cost
        self.make_params = make_params
        self.listeners = listeners
        # ``pool_blocks``: allocate fewer blocks than the configured pool when the workload
        # cannot fill it (see ``Simulator.pool_blocks``); the decisions are the same.
        self.num_kv_blocks = setup.cache.num_kv_blocks or 0
        self.kv = KVCacheManager(pool_blocks or self.num_kv_blocks, setup.cache.block_size,
                                 setup.cache.enable_prefix_caching, setup.kv_hash_key)
        self.scheduler = Scheduler(setup.scheduler, self.kv, setup.max_model_len)
        self._live: dict[str, tuple[Request, RequestMetrics]] = {}
        # Routed here but not yet handed to the scheduler: like the engine's loop, a replica
        # takes new requests between steps, so one arriving mid-step waits for the update.
        self.inbox: list[WorkloadRequest] = []
        self._sampled = [setup.fake_token]  # shared: update() only reads it
        self.in_flight: SchedulerOutput | None = None
        self.step_start = 0.0
        self.num_steps = 0
        self.busy_time = 0.0

    # ---- requests ------------------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return len(self.scheduler.requests) + len(self.inbox)

    def take_inbox(self) -> list[tuple[str, str]]:
        """Add the requests routed here since the last step; returns (id, why) of refusals."""
        refused = []
        for item in self.inbox:
            try:
                self.add(item)
            except ValueError as e:
                kind = "rejected" if isinstance(e, QueueFull) else "invalid"
                refused.append((item.request_id, f"{kind}: {e}"))
        self.inbox.clear()
        return refused

    def add(self, item: WorkloadRequest) -> None:
        """Queue a request as ``LLMEngine.add_request`` would; ValueError (QueueFull when the
        queue is full) if it refuses."""
        params = self.make_params(item)
        if params.n != 1:
            raise ValueError(f"the simulator runs one sequence per request, got n={params.n}")
        prompt = item.prompt_token_ids
        model = self.setup.model
        validate_prompt(prompt, params, vocab_size=model.vocab_size,
                        max_model_len=model.max_model_len, has_tokenizer=False)
        validate_scheduling(item.priority, item.tenant, item.slo_ttft_ms, item.slo_tpot_ms)
        if self.scheduler.queue_full(params.n):
            self.scheduler.stats.num_rejected += 1
            raise QueueFull(f"the waiting queue is full "
                            f"({self.setup.scheduler.max_queue_len} requests)")
        # A request carries its effective targets: its own, else the server's defaults.
        policy = self.setup.scheduler.policy
        slo_ttft, slo_tpot = item.slo_ttft_ms, item.slo_tpot_ms
        req = Request(item.request_id, prompt, params, item.arrival_s, priority=item.priority,
                      tenant=item.tenant or "default",
                      max_tokens=capped_max_tokens(params, len(prompt), model.max_model_len),
                      slo_ttft_s=slo_ttft / 1e3 if slo_ttft is not None
                      else policy.default_slo_ttft_s,
                      slo_tpot_s=slo_tpot / 1e3 if slo_tpot is not None
                      else policy.default_slo_tpot_s)
        self.scheduler.add_request(req, item.arrival_s)
        self._live[req.request_id] = (req, RequestMetrics.for_request(req))

    # ---- the step ------------------------------------------------------------------------
    def start_step(self, now: float) -> float | None:
        """Schedule a step at ``now``; returns when it ends, or None if nothing ran."""
        out = self.scheduler.schedule(now)
        if out.is_empty:
            # Still hand the scheduler its update, as the engine does: it reports requests
            # it finished by itself (queue-wait rejections).
            self._record(self.scheduler.update(out, ModelRunnerOutput(), now), now)
            return None
        duration = self.cost.step_time(batch_shape(out))
        if not duration > 0.0:
            raise ValueError(f"cost model {self.cost.describe()} returned a step time of "
                             f"{duration!r} s; it must be positive")
        self.in_flight = out
        self.step_start = now
        return now + duration

    def finish_step(self, now: float) -> list[tuple[str, RequestMetrics]]:
        """The step in flight ends at ``now``; returns the requests it finished."""
        out = self.in_flight
        assert out is not None, "finish_step without a step in flight"
        self.in_flight = None
        self.num_steps += 1
        self.busy_time += now - self.step_start
        if self.listeners:
            for listener in self.listeners:
                listener(self.index, self.step_start, now, out)
        sampled = self._sampled
        run = ModelRunnerOutput({rid: sampled for rid in out.sampling_req_ids})
        return self._record(self.scheduler.update(out, run, now), now)

    def _record(self, updates: list, now: float) -> list[tuple[str, RequestMetrics]]:
        finished = []
        live = self._live
        for upd in updates:
            req, metrics = live[upd.request_id]
            if upd.new_token_ids:
                metrics.record_tokens(len(upd.new_token_ids), now)
            if upd.status is not RUNNING and upd.status.is_finished:
                metrics.finalize(req, len(metrics.token_times), upd.status.finish_reason, now)
                del live[upd.request_id]
                finished.append((upd.request_id, metrics))
        return finished

    def unfinished_ids(self) -> list[str]:
        return list(self._live)
