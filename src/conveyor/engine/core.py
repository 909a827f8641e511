"""The engine core: the scheduler and the KV cache manager around an executor.

    sched_out = scheduler.schedule(clock())          # which tokens of which requests
    run_out   = executor.execute_model(sched_out)    # the model (or a cost model) runs
    outputs   = scheduler.update(sched_out, run_out, clock())   -> EngineCoreOutputs

The core imports no torch and reads time only through the clock it is given, so the
same class serves the engine (an in-process model runner, wall clock), the simulator
(a cost-model executor, virtual clock) and the bench's model clock. It knows token
ids only: text, stop strings and n > 1 fan-out belong to the front end, which adds
one ``EngineCoreRequest`` per sample and aborts a request whose stop string it found.

Request state has one owner, the scheduler's ``Request``; the executor keeps only its
per-request batch state, updated from each ``SchedulerOutput``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from conveyor.config import EngineConfig, kv_hash_key
from conveyor.config.kv_window import (
    kv_free_window,
    kv_groups,
    kv_groups_off_reason,
    model_layer_windows,
)
from conveyor.config.lora import lora_tenant
from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.core.kv_groups import HybridKVCacheManager
from conveyor.core.scheduler import Scheduler
from conveyor.core.scheduler_output import ModelRunnerOutput, RequestUpdate, SchedulerOutput
from conveyor.costs.protocol import StepCostModel
from conveyor.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    QueueFullError,
    UtilityMethod,
)
from conveyor.engine.validation import (
    capped_max_tokens,
    validate_lora,
    validate_prompt,
    validate_scheduling,
)
from conveyor.kv_transfer.connector import KVConnectorScheduler
from conveyor.request import Request, RequestStatus
from conveyor.spec.speculator import Speculator
from conveyor.timings import PhaseTimings

__all__ = ["EngineCore", "Executor", "QueueFullError"]

# /v1/kv_summary: hashes cut to 8 bytes (16 hex digits), 8,192 of them unless asked.
KV_SUMMARY_HASH_BYTES = 8
KV_SUMMARY_DEFAULT_BLOCKS = 8192
KV_SUMMARY_MAX_BLOCKS = 65536

_FINISH_STATUS = {"stop": RequestStatus.FINISHED_STOPPED,
                  "abort": RequestStatus.FINISHED_ABORTED}

logger = logging.getLogger(__name__)


class Executor(Protocol):
    """Runs the model for the core (``executor/``): in-process runner, cost model, later
    tensor-parallel and Ray workers. The KV pool is sized by the executor before the core
    exists (``determine_num_kv_blocks``, then ``initialize``: see ``executor/``)."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor,
                 clock: Callable[[], float] = time.monotonic,
                 num_kv_blocks: int | None = None,
                 step_cost: StepCostModel | None = None) -> None:
        """``num_kv_blocks``: allocate fewer blocks than the configured pool (the simulator
        does when a workload cannot fill it: the decisions are the same). ``step_cost``:
        the step-cost model the scheduler's SLO token budget controller prices steps with
        (``core/budget.py``; None: a fixed budget)."""
        self.config = config
        self.executor = executor
        self.clock = clock
        cache = config.cache
        assert cache.num_kv_blocks is not None, "resolve the KV pool before the core"
        groups = kv_groups(config)  # a hybrid model's layer groups (None: one table)
        if groups is None and len(set(model_layer_windows(config.model))) > 1:
            logger.info("hybrid model: whole contexts kept in every layer (%s)",
                        kv_groups_off_reason(config) or "several windows")
        if groups is not None and num_kv_blocks is None:
            self.kv: KVCacheManager | HybridKVCacheManager = HybridKVCacheManager(
                groups.num_full_blocks, groups.num_window_blocks, cache.block_size,
                groups.window, cache.enable_prefix_caching, kv_hash_key(config.model))
        else:
            self.kv = KVCacheManager(num_kv_blocks or cache.num_kv_blocks, cache.block_size,
                                     cache.enable_prefix_caching, kv_hash_key(config.model),
                                     sliding_window=kv_free_window(config))
        # Prefill/decode disaggregation: the KV connector's scheduler half (None: "both").
        self.kv_connector = (KVConnectorScheduler(config.kv_transfer, self.kv)
                             if config.kv_transfer.enabled else None)
        # Speculative decoding beside the scheduler (None: off).
        speculative = config.scheduler.speculative
        self.speculation = Speculator(speculative) if speculative is not None else None
        self.scheduler = Scheduler(config.scheduler, self.kv, config.model.max_model_len,
                                   step_cost=step_cost, connector=self.kv_connector,
                                   speculation=self.speculation)
        self.eos_token_ids = frozenset(config.model.eos_token_ids)
        self.num_prompt_tokens = 0  # each admitted prompt once, cache hits included
        self.num_generation_tokens = 0
        self.num_finished = 0
        self.num_step_errors = 0  # steps that raised (the engine loop failed their requests)
        self.timings = PhaseTimings()
        # --async-scheduling: step n+1 scheduled while step n runs (engine/async_steps.py).
        self.async_steps = None
        if config.scheduler.async_scheduling:
            from conveyor.engine.async_steps import AsyncSteps

            self.async_steps = AsyncSteps(self)

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    # ---- requests ------------------------------------------------------------------------
    def validate(self, req: EngineCoreRequest) -> None:
        """Raise ValueError naming what is wrong with a request the core would refuse."""
        cfg = self.config
        validate_prompt(req.prompt_token_ids, req.sampling_params,
                        vocab_size=cfg.model.vocab_size, max_model_len=self.max_model_len,
                        has_tokenizer=True,  # stop strings are the front end's
                        max_queue_len=cfg.scheduler.max_queue_len)
        validate_scheduling(req.priority, req.tenant, req.slo_ttft_ms, req.slo_tpot_ms)
        validate_lora(cfg, req.lora_request, check_files=False)
        if req.sampling_params.structured_outputs is not None:
            # Only a runner with grammar matchers honours them (executor/local.py), and
            # only where the grammar engine reads the tokenizer.
            check = getattr(self.executor, "structured_outputs_unsupported", None)
            reason = (check() if check is not None else
                      f"the {type(self.executor).__name__} has no grammar matchers")
            if reason:
                raise ValueError(f"structured_outputs are not supported here: {reason}")
        if req.kv_transfer_params is not None:
            if req.sampling_params.prompt_logprobs is not None:
                # A decode engine never sees the prompt's logits, and a prefill engine's
                # output is the first token only.
                raise ValueError("prompt_logprobs cannot be computed for a request whose "
                                 "prompt K/V moves between engines (kv_transfer_params)")
            if self.kv_connector is None:
                raise ValueError("kv_transfer_params needs an engine started with --kv-role "
                                 "prefill or decode (this one is --kv-role both)")
            self.kv_connector.check_params(req.kv_transfer_params)

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        """Queue requests together, all or none: ValueError for bad input or an id in use,
        QueueFullError when admission control has no room for all of them."""
        for req in reqs:
            self.validate(req)
            if req.request_id in self.scheduler.requests:
                raise ValueError(f"request id {req.request_id!r} is already in use")
        if len({r.request_id for r in reqs}) != len(reqs):
            raise ValueError("request ids repeat within one add")
        if self.scheduler.queue_full(len(reqs)):
            self.scheduler.stats.num_rejected += 1
            raise QueueFullError(f"the waiting queue is full "
                                 f"({self.config.scheduler.max_queue_len} requests)")
        for req in reqs:
            self.scheduler.add_request(self._request(req), req.arrival_time)

    def add_request(self, req: EngineCoreRequest) -> None:
        self.add_requests([req])

    def _request(self, req: EngineCoreRequest) -> Request:
        params = req.sampling_params
        policy = self.config.scheduler.policy
        # The request carries its effective targets (its own, else the server's defaults),
        # so that policies read one place.
        slo_ttft_s, slo_tpot_s = req.slo_targets_s(policy.default_slo_ttft_s,
                                                   policy.default_slo_tpot_s)
        max_tokens = capped_max_tokens(params, len(req.prompt_token_ids), self.max_model_len)
        kv = req.kv_transfer_params
        if kv is not None and kv.do_remote_decode:
            max_tokens = 1  # a prefill engine's request ends with its first token
        return Request(
            req.request_id, req.prompt_token_ids,
            params.clone(eos_token_ids=self.eos_token_ids), req.arrival_time,
            priority=req.priority, tenant=lora_tenant(req.tenant, req.lora_request),
            max_tokens=max_tokens, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s,
            kv_params=kv, lora_request=req.lora_request)

    def abort_requests(self, request_ids: list[str], reason: str = "abort",
                       stop_reason: str | None = None) -> list[EngineCoreOutput]:
        """Finish requests wherever they are (blocks freed at once); unknown ids are
        ignored. ``reason`` "stop": a stop string the front end found. Returns the final
        output of each request this finished."""
        status = _FINISH_STATUS[reason]
        now = self.clock()
        found = [self.scheduler.requests[rid] for rid in dict.fromkeys(request_ids)
                 if rid in self.scheduler.requests]
        self.scheduler.finish_requests([r.request_id for r in found], status)
        outs = []
        for req in found:
            req.finished_time = now
            if stop_reason is not None:
                req.stop_reason = stop_reason
            outs.append(self._output(req, [], None, status.finish_reason, req.stop_reason))
        self.num_finished += len(outs)
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def reset_prefix_cache(self) -> int:
        """Forget the cached prefix blocks no request holds; returns how many were dropped."""
        return self.kv.reset_prefix_cache()

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        if self.async_steps is not None:
            return self.async_steps.step()
        t0 = time.perf_counter()
        sched_out = self.schedule()
        t1 = time.perf_counter()
        run_out = self.executor.execute_model(sched_out)
        t2 = time.perf_counter()
        outputs = self.update(sched_out, run_out)
        self.timings.add("schedule", t1 - t0)
        self.timings.add("execute", t2 - t1)
        self.timings.add("update", time.perf_counter() - t2)
        return outputs

    def schedule(self) -> SchedulerOutput:
        """The first half of a step (the simulator runs the halves at two times)."""
        sched_out = self.scheduler.schedule(self.clock())
        for new in sched_out.new_reqs:
            req = self.scheduler.requests.get(new.req_id)
            if req is not None and req.num_preemptions == 0:
                self.num_prompt_tokens += len(new.prompt_token_ids)
        return sched_out

    def update(self, sched_out: SchedulerOutput, run_out: ModelRunnerOutput
               ) -> EngineCoreOutputs:
        """The second half: fold the executor's tokens into the requests."""
        now = self.clock()
        updates = self.scheduler.update(sched_out, run_out, now)
        outs = [self._from_update(u) for u in updates]
        self.num_generation_tokens += sum(len(o.new_token_ids) for o in outs)
        self.num_finished += sum(1 for o in outs if o.finish_reason is not None)
        return EngineCoreOutputs(outs, now, not sched_out.is_empty)

    def _from_update(self, upd: RequestUpdate) -> EngineCoreOutput:
        req = upd.request
        assert req is not None
        reason = upd.status.finish_reason if upd.status.is_finished else None
        return self._output(req, upd.new_token_ids, upd.new_logprobs, reason, upd.stop_reason,
                            upd.prompt_logprobs)

    @staticmethod
    def _output(req: Request, tokens: list[int], logprobs, reason: str | None,
                stop_reason, prompt_logprobs=None) -> EngineCoreOutput:
        return EngineCoreOutput(
            req.request_id, tokens, logprobs, reason, stop_reason,
            max(req.num_cached_tokens, 0), req.num_preemptions, req.first_scheduled_time,
            req.finished_time if reason is not None else None, prompt_logprobs)

    # ---- introspection -------------------------------------------------------------------
    def utility(self, method: UtilityMethod, *args: int) -> Any:
        """The typed utility calls a front end may make between steps."""
        if method is UtilityMethod.STATS:
            return self.stats()
        if method is UtilityMethod.KV_SUMMARY:
            return self.kv_summary(args[0] if args else KV_SUMMARY_DEFAULT_BLOCKS)
        if method is UtilityMethod.NUM_FREE_BLOCKS:
            return self.kv.num_free_blocks
        if method is UtilityMethod.RESET_PREFIX_CACHE:
            return self.reset_prefix_cache()
        if method is UtilityMethod.HAS_UNFINISHED:
            return self.has_unfinished_requests()
        if method is UtilityMethod.CHECK_INVARIANTS:
            self.scheduler.check_invariants()
            return True
        raise ValueError(f"unknown utility method {method!r}")

    def kv_summary(self, max_blocks: int) -> dict[str, Any]:
        """The prefix-cache blocks a router may count on, and the load. Hashes are cut to
        their first ``KV_SUMMARY_HASH_BYTES`` bytes: a collision only misroutes."""
        hashes = self.kv.pool.cached_hashes(max_blocks) if self.kv.enable_prefix_caching else []
        return {
            "block_size": self.kv.block_size,
            "hash_key": self.kv.hash_key.hex(),
            "hash_bytes": KV_SUMMARY_HASH_BYTES,
            "block_hashes": [h[:KV_SUMMARY_HASH_BYTES].hex() for h in hashes],
            "num_cached_blocks": self.kv.pool.num_cached_blocks,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_blocks_in_use": self.kv.pool.num_used_blocks,
            "num_kv_blocks": self.kv.num_blocks,
        }

    def stats(self) -> dict[str, Any]:
        s = self.scheduler.stats
        return {
            "scheduling_policy": self.scheduler.policy.name,
            "num_steps": s.num_steps,
            "num_preemptions": s.num_preemptions,
            "num_admission_preemptions": s.num_admission_preemptions,
            "num_rejected": s.num_rejected,
            "num_wait_rejected": s.num_wait_rejected,
            "num_slo_rejected": s.num_slo_rejected,
            "num_overdue": s.num_overdue,
            "peak_running": s.peak_running,
            "peak_waiting": s.peak_waiting,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_kv_blocks": self.kv.num_blocks,
            "num_free_kv_blocks": self.kv.num_free_blocks,
            "peak_kv_blocks": self.kv.peak_used_blocks,
            "kv_blocks_in_use": self.kv.pool.num_used_blocks,
            "kv_usage": self.kv.usage,
            "kv_window_freed_blocks": self.kv.num_window_freed,  # behind a sliding window
            # A hybrid model's windowed layers' pool (the rest above is the full layers').
            "kv_window_group": ({"num_blocks": self.kv.windowed.num_blocks,
                                 "blocks_in_use": self.kv.windowed.pool.num_used_blocks,
                                 "peak_blocks": self.kv.windowed.peak_used_blocks}
                                if isinstance(self.kv, HybridKVCacheManager) else None),
            "prefix_cache_queries": self.kv.stats.queries,
            "prefix_cache_hits": self.kv.stats.hits,
            "prefix_cache_hit_rate": self.kv.stats.hit_rate,
            "cached_blocks": self.kv.pool.num_cached_blocks,
            "evictable_blocks": self.kv.pool.num_evictable_blocks,
            "num_finished": self.num_finished,
            "num_step_errors": self.num_step_errors,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
            "scheduled_tokens": s.total_scheduled_tokens,
            "prompt_tokens_computed": s.num_prompt_tokens_computed,
            "kv_transfer": (self.kv_connector.stats_dict() if self.kv_connector is not None
                            else None),
            "num_batched_rows": s.num_batched_rows,
            # Prefills sharing steps: partial ones summed over steps (mean: / num_steps),
            # the most in a step, pauses of a started prefill and their total time.
            "num_partial_prefills": s.num_partial_prefills,
            "peak_partial_prefills": s.peak_partial_prefills,
            "num_paused_prefills": s.num_paused_prefills,
            "prefill_paused_s": s.prefill_paused_s,
            "max_model_len": self.max_model_len,
            "policy": self.scheduler.policy.stats(),
            "token_budget": self.token_budget_stats(),
            "spec_decode": (self.speculation.metrics.as_dict()
                            if self.speculation is not None else None),
            # Multi-LoRA: adapters loaded and loading for the core, loads ordered so far.
            "lora": (self.scheduler.lora_loads.stats()
                     if self.scheduler.lora_loads is not None else None),
        }

    def token_budget_stats(self) -> dict[str, Any]:
        """The budget controller's figures, or the fixed budget and why it is fixed."""
        sched = self.scheduler
        if sched.budget_ctrl is not None:
            return sched.budget_ctrl.stats_dict()
        return {"mode": "fixed", "ceiling": self.config.scheduler.max_num_batched_tokens,
                "reason": sched.budget_reason}
