"""The offline front end: text in and out around an in-process ``EngineCore``.

    ids      = tokenize(prompt)                          # the front end owns text
    core.add_requests(fan_out(ids, params))              # one core request per sample
    outs     = core.step()                               # schedule, execute, update
    outputs, stopped, _ = output_processor.process(outs) # text, stop strings, n > 1
    core.abort_requests(stopped, reason="stop")          # a stop string ends a sample

The server's ``AsyncEngine`` is the same front end around a core in a thread or in an
engine-core process of its own (``engine_loop.py``, ``core_process.py``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

from conveyor.config import EngineArgs, EngineConfig
from conveyor.config.lora import LoRARequest
from conveyor.engine.core import EngineCore
from conveyor.engine.detokenizer import load_tokenizer
from conveyor.engine.messages import QueueFullError
from conveyor.engine.output_processor import OutputProcessor, fan_out
from conveyor.engine.validation import (
    check_structured_outputs,
    validate_lora,
    validate_prompt,
    validate_scheduling,
)
from conveyor.kv_transfer.messages import KVTransferParams
from conveyor.outputs import RequestMetrics, RequestOutput
from conveyor.sampling_params import SamplingParams

PromptType = str | list[int] | dict[str, Any]

__all__ = ["LLMEngine", "PromptType", "QueueFullError", "tokenize_prompt"]


def tokenize_prompt(tokenizer: Any, prompt: PromptType) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt: a string, token ids, or a dict of either."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            prompt = prompt["prompt"]
        else:
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        return prompt, tokenizer.encode(prompt, add_special_tokens=False) if prompt else []
    if isinstance(prompt, list | tuple):
        return None, list(prompt)
    raise ValueError(f"prompt must be a string, a list of token ids or a dict, "
                     f"got {type(prompt).__name__}")


def validate_request(config: EngineConfig, has_tokenizer: bool, prompt_ids: list[int],
                     params: SamplingParams) -> None:
    """The front end's checks of a user request (n included) before it fans out."""
    validate_prompt(prompt_ids, params, vocab_size=config.model.vocab_size,
                    max_model_len=config.model.max_model_len, has_tokenizer=has_tokenizer,
                    max_queue_len=config.scheduler.max_queue_len)
    if params.structured_outputs is not None:
        check_structured_outputs(params.structured_outputs, has_tokenizer)


class LLMEngine:
    def __init__(self, args: EngineArgs, clock: Callable[[], float] = time.monotonic,
                 log_stats: bool = False, core: EngineCore | None = None) -> None:
        if core is None:
            from conveyor.engine.local_core import build_local_core

            core = build_local_core(args, clock)
        self.core = core
        self.config: EngineConfig = core.config
        model_cfg = self.config.model
        self.tokenizer = load_tokenizer(model_cfg.tokenizer) if model_cfg.tokenizer else None
        self.output_processor = OutputProcessor(self.tokenizer, self.config.scheduler.policy)
        self._ids = itertools.count()
        self.finished_metrics: list[RequestMetrics] = []
        self.keep_metrics = True
        self.step_listeners: list[Callable[[LLMEngine, list[RequestMetrics]], None]] = []

    # The core's parts, for callers in this process (tests, the bench, the offline API).
    @property
    def clock(self) -> Callable[[], float]:
        return self.core.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.core.clock = clock

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def kv(self):
        return self.core.kv

    @property
    def runner(self):
        return getattr(self.core.executor, "runner", None)

    @property
    def timings(self):
        return self.core.timings

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    @property
    def num_finished(self) -> int:
        return self.core.num_finished

    @property
    def num_prompt_tokens(self) -> int:
        return self.core.num_prompt_tokens

    @property
    def num_generation_tokens(self) -> int:
        return self.core.num_generation_tokens

    # ---- requests ------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return tokenize_prompt(self.tokenizer, prompt)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        validate_request(self.config, self.tokenizer is not None, prompt_ids, params)

    validate_scheduling = staticmethod(validate_scheduling)

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    priority: int = 0, tenant: str | None = None,
                    slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
                    output_kind: str = "final",
                    kv_transfer_params: KVTransferParams | None = None,
                    lora_request: LoRARequest | None = None) -> str:
        """Validate and queue a request; raises ValueError (bad input) or QueueFullError."""
        params = params or SamplingParams()
        text, prompt_ids = self.tokenize(prompt)
        self.validate(prompt_ids, params)
        self.validate_scheduling(priority, tenant, slo_ttft_ms, slo_tpot_ms)
        validate_lora(self.config, lora_request)
        request_id = request_id if request_id is not None else str(next(self._ids))
        now = self.clock() if arrival_time is None else arrival_time
        children = fan_out(request_id, prompt_ids, params, now, priority=priority,
                           tenant=tenant, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
                           kv_transfer_params=kv_transfer_params, lora_request=lora_request)
        self.output_processor.add(request_id, text, params, children, output_kind)
        try:
            self.core.add_requests(children)
        except BaseException:
            self.output_processor.fail(request_id)
            raise
        return request_id

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests wherever they are; their blocks are freed at once."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outputs = []
        for rid in request_ids:
            finals = self.core.abort_requests(self.output_processor.child_ids(rid))
            aborted = self.output_processor.abort(rid, self.clock(), finals)
            if aborted is not None:
                outputs.append(aborted[0])
                self._record_finished(aborted[1])
        return outputs

    def reset_prefix_cache(self) -> int:
        """Forget the cached prefix blocks no request holds; returns how many were dropped.
        Blocks in use keep their content until freed (as vLLM's does, minus its refusal)."""
        return self.core.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or bool(self.output_processor.parents)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        core_outputs = self.core.step()
        t0 = time.perf_counter()
        outputs, stopped, finished = self.output_processor.process(core_outputs)
        for child_id, stop in stopped:  # the core frees the sample's blocks now
            self.core.abort_requests([child_id], reason="stop", stop_reason=stop)
        self.core.timings.add("outputs", time.perf_counter() - t0)
        self._record_finished(finished)
        for listener in self.step_listeners:
            listener(self, finished)
        return outputs

    def _record_finished(self, finished: list[RequestMetrics]) -> None:
        if self.keep_metrics:
            self.finished_metrics.extend(finished)

    # ---- introspection -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        return self.core.stats()

    def shutdown(self) -> None:
        """Stop the executor (a tensor-parallel executor's rank processes or actors)."""
        self.core.executor.shutdown()
