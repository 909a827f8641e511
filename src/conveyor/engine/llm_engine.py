"""The synchronous engine: validates requests, steps the scheduler and runner, emits outputs.

    sched_out = scheduler.schedule(now)
    run_out   = runner.execute(sched_out)
    updates   = scheduler.update(sched_out, run_out, now)
    outputs   = output_processor.process(updates)   # text, stop strings, n > 1
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from typing import Any

import torch

from conveyor.config import EngineArgs, EngineConfig
from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.core.scheduler import Scheduler
from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.engine.detokenizer import load_tokenizer
from conveyor.engine.output_processor import OutputProcessor
from conveyor.engine.validation import (
    capped_max_tokens,
    validate_prompt,
    validate_scheduling,
)
from conveyor.model.dtypes import resolve_compute_dtype
from conveyor.outputs import RequestMetrics, RequestOutput
from conveyor.request import Request, RequestStatus
from conveyor.runner.model_runner import ModelRunner
from conveyor.sampling_params import SamplingParams
from conveyor.timings import PhaseTimings

PromptType = str | list[int] | dict[str, Any]


class QueueFullError(RuntimeError):
    """Admission control refused a request (the waiting queue is at max_queue_len)."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class LLMEngine:
    def __init__(self, args: EngineArgs, clock: Callable[[], float] = time.monotonic,
                 log_stats: bool = False) -> None:
        self.clock = clock
        device = resolve_device(args.device)
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        model_cfg = args.resolve_model()
        model_cfg = dataclasses.replace(model_cfg, compute_dtype=resolve_compute_dtype(
            args.compute_dtype, model_cfg.dtype, device))
        cache_cfg = args.cache_config()
        self.runner = ModelRunner(model_cfg, cache_cfg, device, args.attention_backend,
                                  args.linear_backend)
        # The pool is sized after the weights are loaded, from what memory is left.
        num_blocks = self.runner.allocate_kv_cache(cache_cfg.num_kv_blocks, args.max_num_seqs)
        # Derived values are computed once, into a new config (never patched in place).
        max_len = min(model_cfg.max_model_len, num_blocks * cache_cfg.block_size)
        model_cfg = dataclasses.replace(model_cfg, max_model_len=max_len)
        self.config = EngineConfig(
            model=model_cfg, cache=dataclasses.replace(cache_cfg, num_kv_blocks=num_blocks),
            scheduler=args.scheduler_config(), device=str(device), num_threads=args.num_threads)
        extra = f"{model_cfg.path}|{model_cfg.math_dtype}|{model_cfg.load_format}|{model_cfg.seed}"
        self.kv = KVCacheManager(num_blocks, cache_cfg.block_size,
                                 cache_cfg.enable_prefix_caching, extra.encode())
        self.scheduler = Scheduler(self.config.scheduler, self.kv, max_len)
        if args.warmup:  # before any request: its K/V lands in blocks nobody owns yet
            self.runner.warmup(self.config.scheduler.max_num_batched_tokens, max_len - 1)
        self.tokenizer = load_tokenizer(model_cfg.tokenizer) if model_cfg.tokenizer else None
        self.output_processor = OutputProcessor(self.tokenizer)
        self.eos_token_ids = frozenset(model_cfg.eos_token_ids)
        self._ids = itertools.count()
        self.finished_metrics: list[RequestMetrics] = []
        self.keep_metrics = True
        self.num_finished = 0
        self.num_step_errors = 0  # steps that raised (the async loop failed their requests)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.timings = PhaseTimings()
        self.step_listeners: list[Callable[[LLMEngine, list[RequestMetrics]], None]] = []

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    # ---- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass token ids")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False) \
                if prompt else []
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, "
                         f"got {type(prompt).__name__}")

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(prompt_ids, params, vocab_size=self.config.model.vocab_size,
                        max_model_len=self.max_model_len,
                        has_tokenizer=self.tokenizer is not None,
                        max_queue_len=self.config.scheduler.max_queue_len)

    # Shared with the simulator (torch-free module).
    validate_scheduling = staticmethod(validate_scheduling)

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    priority: int = 0, tenant: str | None = None,
                    slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
                    output_kind: str = "final") -> str:
        """Validate and queue a request; raises ValueError (bad input) or QueueFullError."""
        params = params or SamplingParams()
        text, prompt_ids = self.tokenize(prompt)
        self.validate(prompt_ids, params)
        self.validate_scheduling(priority, tenant, slo_ttft_ms, slo_tpot_ms)
        if self.scheduler.queue_full(params.n):
            self.scheduler.stats.num_rejected += 1
            raise QueueFullError(f"the waiting queue is full "
                                 f"({self.config.scheduler.max_queue_len} requests)")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.output_processor.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        now = self.clock() if arrival_time is None else arrival_time
        max_tokens = capped_max_tokens(params, len(prompt_ids), self.max_model_len)
        params = params.clone(eos_token_ids=self.eos_token_ids)
        # The request carries its effective targets (its own, else the server's defaults),
        # so that policies and metrics read one place.
        policy_cfg = self.config.scheduler.policy
        slo_ttft_s = slo_ttft_ms / 1e3 if slo_ttft_ms is not None \
            else policy_cfg.default_slo_ttft_s
        slo_tpot_s = slo_tpot_ms / 1e3 if slo_tpot_ms is not None \
            else policy_cfg.default_slo_tpot_s
        children = []
        for k in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.clone(seed=params.seed + k)
            child_id = request_id if params.n == 1 else f"{request_id}#{k}"
            children.append(Request(
                child_id, prompt_ids, child_params, now, priority=priority,
                tenant=tenant or "default", max_tokens=max_tokens,
                slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s))
        self.output_processor.add(request_id, text, params, children, output_kind)
        for req in children:
            self.scheduler.add_request(req, now)
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests wherever they are; their blocks are freed at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        now = self.clock()
        for rid in request_ids:
            children = self.output_processor.child_ids(rid)
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            aborted = self.output_processor.abort(rid, now)
            if aborted is not None:
                outputs.append(aborted[0])
                self._record_finished(aborted[1])
        return outputs

    def reset_prefix_cache(self) -> int:
        """Forget the cached prefix blocks no request holds; returns how many were dropped.
        Blocks in use keep their content until freed (as vLLM's does, minus its refusal)."""
        return self.kv.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.output_processor.parents)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        sched_out = self.scheduler.schedule(self.clock())
        self._count_new_prompts(sched_out)
        t1 = time.perf_counter()
        run_out = self.runner.execute(sched_out)
        t2 = time.perf_counter()
        now = self.clock()
        updates = self.scheduler.update(sched_out, run_out, now)
        t3 = time.perf_counter()
        outputs, stopped, finished = self.output_processor.process(updates, now)
        self.timings.add("schedule", t1 - t0)
        self.timings.add("execute", t2 - t1)
        self.timings.add("update", t3 - t2)
        self.timings.add("outputs", time.perf_counter() - t3)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for rid in stopped:
            # The scheduler did not see this finish: give the request its finish time.
            entry = self.output_processor.child_to_parent.get(rid)
            if entry is not None:
                entry[1].request.finished_time = now
        for upd in updates:
            self.num_generation_tokens += len(upd.new_token_ids)
        self._record_finished(finished)
        for listener in self.step_listeners:
            listener(self, finished)
        return outputs

    def _count_new_prompts(self, sched_out: SchedulerOutput) -> None:
        """Each prompt counts once, cached tokens included, when first admitted (a prefix hit
        starts with num_computed_tokens > 0; a preempted request comes back as new)."""
        for new in sched_out.new_reqs:
            req = self.scheduler.requests.get(new.req_id)
            if req is not None and req.num_preemptions == 0:
                self.num_prompt_tokens += len(new.prompt_token_ids)

    def _record_finished(self, finished: list[RequestMetrics]) -> None:
        self.num_finished += len(finished)
        if self.keep_metrics:
            self.finished_metrics.extend(finished)

    # ---- introspection -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        s = self.scheduler.stats
        return {
            "scheduling_policy": self.scheduler.policy.name,
            "num_steps": s.num_steps,
            "num_preemptions": s.num_preemptions,
            "num_admission_preemptions": s.num_admission_preemptions,
            "num_rejected": s.num_rejected,
            "num_wait_rejected": s.num_wait_rejected,
            "num_overdue": s.num_overdue,
            "peak_running": s.peak_running,
            "peak_waiting": s.peak_waiting,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "num_kv_blocks": self.kv.num_blocks,
            "peak_kv_blocks": self.kv.peak_used_blocks,
            "kv_blocks_in_use": self.kv.pool.num_used_blocks,
            "kv_usage": self.kv.usage,
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
            "max_model_len": self.max_model_len,
            "policy": self.scheduler.policy.stats(),
        }
