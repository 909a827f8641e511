"""One simulated engine replica: the real ``EngineCore`` over a cost-model executor.

A step is ``EngineCore.step`` cut in its two halves, run at two virtual times:

    out = core.schedule()                  # at the step's start: the real scheduler decides
    run = executor.execute_model(out)      # a fake token per sampling request, and the
    end = start + executor.last_step_s     #   step time the cost model says
    core.update(out, run)                  # at the step's end

The fake token is never an end-of-sequence token: requests run to ``max_tokens``
(their trace output length, with ``ignore_eos``), as a benchmark with a real model
forces them to. Requests are added as the engine adds them (``core.add_request``), and
per-request ``RequestMetrics`` are filled by the same methods the front end uses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from conveyor.config import EngineConfig
from conveyor.config.lora import LoRARequest
from conveyor.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from conveyor.costs.protocol import MachineCostModel, StepCostModel
from conveyor.engine.core import EngineCore
from conveyor.engine.messages import EngineCoreOutputs, EngineCoreRequest, QueueFullError
from conveyor.executor.cost_model import CostModelExecutor
from conveyor.executor.lora_slots import AdapterSlots
from conveyor.outputs import RequestMetrics
from conveyor.sampling_params import SamplingParams


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
    # (optional) ``lora``: the adapter's name (None: the base model); needs --enable-lora



# Listener called after every step: (replica index, start, end, the step's SchedulerOutput).
StepListener = Callable[[int, float, float, SchedulerOutput], None]


def default_params(item: WorkloadRequest, eos_token_ids: frozenset[int] = frozenset()
                   ) -> SamplingParams:
    """Run to the trace's output length: greedy, ``max_tokens=output_len``, ``ignore_eos``."""
    return SamplingParams(max_tokens=item.output_len, temperature=0.0, ignore_eos=True,
                          eos_token_ids=eos_token_ids)


class VirtualClock:
    """The replica's clock: the simulator sets it to each event's time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimReplica:
    def __init__(self, index: int, config: EngineConfig, cost: MachineCostModel,
                 make_params: Callable[[WorkloadRequest], SamplingParams],
                 listeners: list[StepListener], pool_blocks: int | None = None,
                 step_cost: StepCostModel | None = None, lora_swap_s: float = 0.0) -> None:
        """``lora_swap_s``: seconds a step pays per adapter it swaps into one of the
        ``max_loras`` slots (``executor/lora_slots.py``; with LoRA on)."""
        self.index = index
        self.config = config
        self.make_params = make_params
        self.listeners = listeners
        # ``pool_blocks``: allocate fewer blocks than the configured pool when the workload
        # cannot fill it (see ``Simulator.pool_blocks``); the decisions are the same.
        self.num_kv_blocks = config.cache.num_kv_blocks or 0
        self.clock = VirtualClock()
        slots = (AdapterSlots(config.lora.max_loras, lora_swap_s)
                 if config.lora is not None else None)
        self.executor = CostModelExecutor(cost, config.model,
                                          speculative=config.scheduler.speculative,
                                          lora_slots=slots)
        self._loras: dict[str, LoRARequest] = {}  # a workload's adapter names, ids from 1
        self.core = EngineCore(config, self.executor, self.clock, num_kv_blocks=pool_blocks,
                               step_cost=step_cost)
        self.kv = self.core.kv
        self.scheduler = self.core.scheduler
        policy = config.scheduler.policy
        self._slo_defaults = (policy.default_slo_ttft_s, policy.default_slo_tpot_s)
        self._live: dict[str, RequestMetrics] = {}
        # Routed here but not yet handed to the scheduler: like the engine's loop, a replica
        # takes new requests between steps, so one arriving mid-step waits for the update.
        self.inbox: list[WorkloadRequest] = []
        self.in_flight: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
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
            except (ValueError, QueueFullError) as e:
                kind = "rejected" if isinstance(e, QueueFullError) else "invalid"
                refused.append((item.request_id, f"{kind}: {e}"))
        self.inbox.clear()
        return refused

    def add(self, item: WorkloadRequest) -> None:
        """Queue a request in the core; ValueError (bad input) or QueueFullError."""
        params = self.make_params(item)
        if params.n != 1:
            raise ValueError(f"the simulator runs one sequence per request, got n={params.n}")
        tenant = item.tenant if item.tenant is not None else "default"
        req = EngineCoreRequest(item.request_id, item.prompt_token_ids, params, item.arrival_s,
                                item.priority, tenant, item.slo_ttft_ms, item.slo_tpot_ms,
                                lora_request=self.lora_request(getattr(item, "lora", None)))
        self.core.add_request(req)
        self._live[req.request_id] = RequestMetrics.for_core_request(req, *self._slo_defaults)

    def lora_request(self, name: str | None) -> LoRARequest | None:
        """The adapter a workload request names (no files: the cost model loads nothing)."""
        if name is None:
            return None
        if name not in self._loras:
            self._loras[name] = LoRARequest(name, len(self._loras) + 1, f"sim://{name}")
        return self._loras[name]

    # ---- the step ------------------------------------------------------------------------
    def start_step(self, now: float) -> float | None:
        """Schedule a step at ``now``; returns when it ends, or None if nothing ran."""
        self.clock.now = now
        out = self.core.schedule()
        while out.is_empty:
            # Still hand the core its update, as the engine does: it reports requests
            # the scheduler finished by itself (queue-wait rejections), and adapters
            # loaded (at once here: the requests that waited for them run now).
            self._record(self.core.update(out, ModelRunnerOutput(
                lora_loaded=out.lora_load_ids)), now)
            if not out.lora_load:
                return None
            out = self.core.schedule()
        run = self.executor.execute_model(out)
        self.in_flight = (out, run)
        self.step_start = now
        return now + self.executor.last_step_s

    def finish_step(self, now: float) -> list[tuple[str, RequestMetrics]]:
        """The step in flight ends at ``now``; returns the requests it finished."""
        assert self.in_flight is not None, "finish_step without a step in flight"
        out, run = self.in_flight
        self.in_flight = None
        self.num_steps += 1
        self.busy_time += now - self.step_start
        if self.listeners:
            for listener in self.listeners:
                listener(self.index, self.step_start, now, out)
        self.clock.now = now
        return self._record(self.core.update(out, run), now)

    def _record(self, outs: EngineCoreOutputs, now: float) -> list[tuple[str, RequestMetrics]]:
        finished = []
        live = self._live
        for o in outs.outputs:
            metrics = live[o.request_id]
            if o.new_token_ids:
                metrics.record_tokens(len(o.new_token_ids), now)
            if o.finish_reason is not None:
                metrics.observe(o)
                metrics.finalize(o.finish_reason, now)
                del live[o.request_id]
                finished.append((o.request_id, metrics))
        return finished

    def unfinished_ids(self) -> list[str]:
        return list(self._live)
