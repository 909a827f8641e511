"""The scheduler's view of a request: token ids and counters, no text, no tensors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from conveyor.config.lora import LoRARequest
from conveyor.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # A decode engine's request whose prompt K/V is arriving from a prefill engine: it
    # holds its blocks, is in neither the waiting queue nor the running batch.
    WAITING_FOR_REMOTE_KV = enum.auto()
    # A constrained request whose grammar is compiling (core/grammar_gate.py): it holds
    # no blocks and is in neither the waiting queue nor the running batch.
    WAITING_FOR_GRAMMAR = enum.auto()
    # Finished states come last so that ``is_finished`` is one comparison.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_REJECTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        # A plain int comparison: looking up an enum member costs more than the test.
        return self._value_ >= _FIRST_FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's ``finish_reason`` for a finished status, else None."""
        return _FINISH_REASONS.get(self)


_FIRST_FINISHED = RequestStatus.FINISHED_STOPPED.value

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_REJECTED: "abort",
}


@dataclass
class Request:
    """One sequence to generate.

    There are no prefill and decode phases: a request has ``num_tokens`` tokens
    (prompt + output) of which ``num_computed_tokens`` have KV in the cache. A
    prefill chunk, a prefix-cache hit, a decode step and a preemption are all
    moves of ``num_computed_tokens``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    tenant: str = "default"
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    # The max_tokens cap after resolving None against max_model_len.
    max_tokens: int = 16

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache the first time the request was scheduled.
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Times on the engine's clock (seconds); the scheduler never reads a clock itself.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    admitted_seq: int = -1  # order of admission into running, for the preemption victim
    # Time a started prefill spent paused (running, prompt unfinished, no tokens in a
    # step: core/prefill_split.py), and since when it is paused (None: not paused).
    prefill_paused_s: float = 0.0
    paused_since: float | None = None
    # Free-form slot for a policy's own bookkeeping (e.g. a deadline); never read elsewhere.
    policy_state: dict = field(default_factory=dict)
    # Speculative decoding: the draft tokens proposed after its last step (verified, in
    # part or whole, at its next), its per-position [accepted, tried] decayed counts (as
    # of output token ``spec_seen_at``: they fade with the tokens after it), and draft
    # 1's plain ones (verifications, and how many accepted it).
    spec_token_ids: list[int] = field(default_factory=list)
    spec_acceptance: list[list[float]] | None = None
    spec_seen_at: int = 0
    spec_first_tries: int = 0
    spec_first_hits: int = 0
    # Its tokens when it last asked for proposals (before that step's) and the step it
    # asked in: a draft model holds valid draft K/V up to about there and catches up on
    # the rest first, unless it proposed in the step just before (a steady proposal).
    spec_proposed_len: int = 0
    spec_proposed_step: int = -2
    # Prefill/decode disaggregation: the request's KVTransferParams (None: none), and
    # whether a load was already tried (a failed one is never retried).
    kv_params: Any = None
    kv_load_tried: bool = False
    # Prompt logprobs (SamplingParams.prompt_logprobs): entry i scores prompt token i + 1;
    # collected chunk by chunk, handed out with the first output token, then dropped.
    # ``num_prompt_logprobs`` counts every entry collected, so a recompute after a
    # preemption adds none twice.
    prompt_logprobs: list = field(default_factory=list)
    num_prompt_logprobs: int = 0
    # Multi-LoRA: the adapter it runs with (None: the base model).
    lora_request: LoRARequest | None = None

    @property
    def lora_id(self) -> int:
        """Its adapter's id, 0 for the base model (the scheduler and the prefix cache key)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs are still to be computed: a prefix-cache hit would skip
        the positions they come from."""
        return (self.sampling_params.prompt_logprobs is not None
                and self.num_prompt_logprobs < len(self.prompt_token_ids) - 1)

    def add_prompt_logprobs(self, first: int, entries: list) -> None:
        """Entries scoring prompt tokens ``first``, ``first + 1``, ...: those not yet held."""
        for k, entry in enumerate(entries):
            if first + k == self.num_prompt_logprobs + 1:
                self.prompt_logprobs.append(entry)
                self.num_prompt_logprobs += 1

    def take_prompt_logprobs(self) -> list | None:
        """The prompt logprobs, once (with the first output token); None when not asked."""
        if self.sampling_params.prompt_logprobs is None or self.num_output_tokens > 1:
            return None
        taken, self.prompt_logprobs = self.prompt_logprobs, []
        return taken

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
