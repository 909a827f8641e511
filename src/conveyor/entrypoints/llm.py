"""The offline API, shaped like vLLM's ``LLM``."""

from __future__ import annotations

import dataclasses
import itertools
import sys
from collections.abc import Sequence
from typing import Any

from conveyor.config import EngineArgs
from conveyor.config.lora import LoRARequest
from conveyor.engine.llm_engine import LLMEngine, PromptType
from conveyor.engine.validation import validate_lora
from conveyor.outputs import RequestOutput
from conveyor.sampling_params import SamplingParams


class LLM:
    """Generate for a batch of prompts with continuous batching.

    >>> llm = LLM(model="path/to/hf_folder", dtype="float32")
    >>> outs = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0.0))
    """

    def __init__(self, model: str = "tiny", **kwargs: Any) -> None:
        names = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown LLM option(s): {', '.join(unknown)}")
        self.engine_args = EngineArgs(model=model, **kwargs)
        self.engine = LLMEngine(self.engine_args)
        self._ids = itertools.count()
        self._hf_tokenizer: Any = None

    def get_tokenizer(self) -> Any:
        """The checkpoint's transformers tokenizer (as vLLM's ``LLM`` returns; the engine's
        front end runs the same tokenizer.json without transformers), loaded on first use."""
        if self._hf_tokenizer is None:
            path = self.engine.config.model.tokenizer
            if path is None:
                return None
            from transformers import AutoTokenizer

            self._hf_tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return self._hf_tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, *,
                 priority: Sequence[int] | None = None,
                 tenant: Sequence[str] | None = None,
                 slo_ttft_ms: Sequence[float | None] | None = None,
                 slo_tpot_ms: Sequence[float | None] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in input order.

        Every prompt is validated before any work starts: a bad one raises ValueError
        and nothing is queued.
        """
        if isinstance(prompts, str | dict) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt given bare
        prompts = list(prompts)
        n = len(prompts)
        params_list = _per_prompt(sampling_params or SamplingParams(), n, "sampling_params")
        priorities = _per_prompt(priority, n, "priority", 0)
        tenants = _per_prompt(tenant, n, "tenant", None)
        ttfts = _per_prompt(slo_ttft_ms, n, "slo_ttft_ms", None)
        tpots = _per_prompt(slo_tpot_ms, n, "slo_tpot_ms", None)
        loras = _per_prompt(lora_request, n, "lora_request", None)
        engine = self.engine
        tokenized = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            try:
                text, token_ids = engine.tokenize(prompt)
                engine.validate(token_ids, params)
                engine.validate_scheduling(priorities[i], tenants[i], ttfts[i], tpots[i])
                validate_lora(engine.config, loras[i])
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            tokenized.append({"prompt": text, "prompt_token_ids": token_ids})
        ids = [f"offline-{next(self._ids)}" for _ in tokenized]
        pending = list(zip(ids, tokenized, params_list, priorities, tenants, ttfts, tpots,
                           loras))
        return self._run(ids, pending, use_tqdm)

    def _admit(self, pending: list[tuple]) -> None:
        """Queue pending requests while admission control (max_queue_len) has room."""
        engine = self.engine
        while pending and not engine.scheduler.queue_full(pending[0][2].n):
            rid, prompt, sp, pr, tenant, ttft, tpot, lora = pending.pop(0)
            engine.add_request(prompt, sp, request_id=rid, priority=pr, tenant=tenant,
                               slo_ttft_ms=ttft, slo_tpot_ms=tpot, lora_request=lora)

    def _run(self, ids: list[str], pending: list[tuple],
             use_tqdm: bool | None) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        bar = None
        if show and len(ids) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req", dynamic_ncols=True)
        wanted = set(ids)
        try:
            self._admit(pending)
            while len(results) < len(ids) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                self._admit(pending)
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    def shutdown(self) -> None:
        """Stop the executor's workers (tensor parallelism); the LLM serves no more."""
        self.engine.shutdown()

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def reset_prefix_cache(self) -> int:
        """Forget cached prefixes (e.g. between benchmark runs); returns blocks dropped."""
        return self.engine.reset_prefix_cache()


def _per_prompt(value: Any, n: int, name: str, default: Any = None) -> list[Any]:
    if value is None:
        return [default] * n
    if isinstance(value, list | tuple):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n
