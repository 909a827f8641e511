"""Request validation against the model, torch-free: the engine and the simulator share it."""

from __future__ import annotations

from conveyor.sampling_params import SamplingParams


def validate_prompt(prompt_ids: list[int], params: SamplingParams, *, vocab_size: int,
                    max_model_len: int, has_tokenizer: bool) -> None:
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
    if params.stop and not has_tokenizer:
        raise ValueError("stop strings need a tokenizer; use stop_token_ids")


def capped_max_tokens(params: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> int:
    """``max_tokens`` resolved against the room the model leaves after the prompt."""
    room = max_model_len - num_prompt_tokens
    return min(params.max_tokens, room) if params.max_tokens is not None else room
