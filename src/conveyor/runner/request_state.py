"""A request's row of the model runner's persistent batch (the target's, and a draft
model's: ``runner/draft_model.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.sampling_params import SamplingParams


@dataclass
class RequestState:
    """A request's row of the persistent batch. Token ids are kept as the sampler needs
    them (prompt and output apart); ``num_computed_tokens`` is the scheduler's, as of
    this step's start."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # prompt + output in one list, for proposers (kept up to date by ``append``).
    all_token_ids: list[int] | None = None
    # The last proposal's drafts and their [k, V] probabilities, where the proposer has a
    # distribution (a draft model for a random request); verified against next step.
    draft_q: tuple[list[int], torch.Tensor] | None = None
    lora_id: int = 0  # its LoRA adapter's id (0: the base model)
    # A hybrid model's windowed layers' block table (None: one table for every layer).
    window_block_ids: list[int] | None = None

    def append(self, tokens: list[int]) -> None:
        self.output_token_ids.extend(tokens)
        if self.all_token_ids is not None:
            self.all_token_ids.extend(tokens)

    def token_ids(self) -> list[int]:
        if self.all_token_ids is None:
            self.all_token_ids = self.prompt_token_ids + self.output_token_ids
        return self.all_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids ``[start, end)`` of prompt + output, without joining the two."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)
