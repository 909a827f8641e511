"""Request validation against the model, torch-free: the engine and the simulator share it."""

from __future__ import annotations

import math

from conveyor.sampling_params import SamplingParams
from conveyor.structured_outputs import StructuredOutputsParams


def validate_prompt(prompt_ids: list[int], params: SamplingParams, *, vocab_size: int,
                    max_model_len: int, has_tokenizer: bool,
                    max_queue_len: int | None = None) -> None:
    """Raise ValueError naming what is wrong with a request the engine would refuse."""
    if not prompt_ids:
        raise ValueError("prompt is empty")
    # Fast check in C first (plain ints in range); the exact scan only when it fails.
    if not (set(map(type, prompt_ids)) == {int}
            and min(prompt_ids) >= 0 and max(prompt_ids) < vocab_size):
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt contains token ids outside [0, {vocab_size}): {bad[:5]}")
    if len(prompt_ids) >= max_model_len:
        raise ValueError(f"prompt has {len(prompt_ids)} tokens, more than this model "
                         f"accepts: max_model_len is {max_model_len} (prompt plus "
                         "at least one generated token)")
    bad_stop = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad_stop:
        raise ValueError(f"stop_token_ids outside [0, {vocab_size}): {bad_stop}")
    bad_bias = [t for t in params.logit_bias or () if t >= vocab_size]
    if bad_bias:
        raise ValueError(f"logit_bias has token ids outside [0, {vocab_size}): {bad_bias[:5]}")
    if max_queue_len is not None and params.n > max_queue_len:
        raise ValueError(f"n: {params.n} samples can never fit in the waiting queue "
                         f"(max_queue_len {max_queue_len})")
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer; use stop_token_ids")


def check_structured_outputs(params: StructuredOutputsParams, has_tokenizer: bool) -> None:
    """ValueError naming what the grammar engine cannot honour (a schema keyword, a bad
    regex or grammar): checked once in the front end, before the request is queued."""
    if not has_tokenizer:
        raise ValueError("structured_outputs need a tokenizer; this model has none")
    params.grammar_text()


def capped_max_tokens(params: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> int:
    """``max_tokens`` resolved against the room the model leaves after the prompt."""
    room = max_model_len - num_prompt_tokens
    return min(params.max_tokens, room) if params.max_tokens is not None else room


def validate_scheduling(priority: int = 0, tenant: str | None = None,
                        slo_ttft_ms: float | None = None,
                        slo_tpot_ms: float | None = None) -> None:
    """Check the per-request scheduling fields; raises ValueError naming the field."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an integer, got {priority!r}")
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise ValueError(f"tenant must be a non-empty string, got {tenant!r}")
    for name, value in (("slo_ttft_ms", slo_ttft_ms), ("slo_tpot_ms", slo_tpot_ms)):
        if value is not None and not (isinstance(value, int | float)
                                      and not isinstance(value, bool)
                                      and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a number > 0, got {value!r}")


def validate_lora(config, lora_request, check_files: bool = True) -> None:
    """A request's adapter (``LoRARequest`` or None) against the engine's ``EngineConfig``:
    LoRA enabled, and (``check_files``) its adapter_config.json readable with a rank
    within ``--max-lora-rank``. Raises ValueError naming what is wrong."""
    if lora_request is None:
        return
    if config.lora is None:
        raise ValueError(f"adapter {lora_request.lora_name!r}: this engine serves no LoRA "
                         "adapters (start it with --enable-lora)")
    if check_files:
        from conveyor.config.lora import check_adapter

        check_adapter(lora_request.lora_path, config.lora.max_lora_rank)
