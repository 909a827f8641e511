"""What the scheduler hands the model runner each step, and what comes back.

Plain data only (ints, lists, the request's SamplingParams): no tensors, so the
scheduler stays testable without torch and the message can cross a process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.config.lora import LoRARequest
from conveyor.core.kv_connector import KVConnectorMeta, KVWorkerReport
from conveyor.request import Request, RequestStatus
from conveyor.sampling_params import SamplingParams
from conveyor.structured_outputs import StructuredOutputsParams


@dataclass
class NewRequestData:
    """A request the runner has no state for: sent whole, once per (re)admission."""

    req_id: str
    prompt_token_ids: list[int]
    # Tokens generated before a preemption; they are recomputed like prompt tokens.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None  # its adapter (None: the base model)
    # A hybrid model's windowed layers' block table (core/kv_groups.py; None: one table
    # for every layer), index for index beside ``block_ids``.
    window_block_ids: list[int] | None = None


@dataclass
class CachedRequestData:
    """A request the runner already knows: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # The table keeps its first this many ids, then ``new_block_ids`` follow (fewer than
    # it holds after speculative decoding gave lookahead blocks back). None: all of them.
    num_kept_blocks: int | None = None
    # The windowed layers' table's new ids, past the same ``num_kept_blocks`` (hybrid
    # models only; None: one table).
    new_window_block_ids: list[int] | None = None


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # req_id -> tokens to compute this step; a request samples when this reaches its end.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Requests whose runner state can be dropped (finished, aborted or preempted since last step).
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Ids of requests that will sample a token this step (their chunk reaches the end).
    sampling_req_ids: set[str] = field(default_factory=set)
    # Speculative decoding: req_id -> the draft tokens it verifies this step. They are part
    # of its ``num_scheduled_tokens`` (1 + len(drafts)), after its last real token.
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> how many drafts to propose for its next step (absent: none).
    num_spec_wanted: dict[str, int] = field(default_factory=dict)
    # Tokens those proposals catch up on beyond a steady proposal's (a draft model's:
    # prompts, text since a pause), for pricing catch-ups (scheduler-side only).
    num_spec_catch_up: int = 0
    # Prefill/decode disaggregation: the KV connector's orders for this step (None: none).
    kv_connector_meta: KVConnectorMeta | None = None
    # Multi-LoRA (core/lora_loads.py): adapters to read ahead, off the step's path, and
    # adapters no request needs any more (applied first).
    lora_load: list[LoRARequest] = field(default_factory=list)
    lora_release: list[int] = field(default_factory=list)

    @property
    def lora_load_ids(self) -> list[int]:
        """What an executor without adapters answers: every load done at once."""
        return [r.lora_int_id for r in self.lora_load]
    # Structured outputs (core/grammar_gate.py): constraint key -> the constraint to
    # compile now (requests wait for it outside the batch), and the keys of compiled
    # grammars the runner drops first (it keeps every other key it compiled).
    grammar_compiles: dict[str, StructuredOutputsParams] = field(default_factory=dict)
    grammar_evictions: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)


@dataclass
class ModelRunnerOutput:
    """Sampled tokens per request that reached the end of its tokens this step."""

    # req_id -> sampled token ids: one, or with drafts the accepted ones and then the
    # target's own (a correction, or the bonus token when every draft survived).
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> draft tokens proposed for its next step.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Seconds the proposer took this step (measured by the executor; data, not a clock).
    propose_s: float = 0.0
    # False when the proposer also caught up this step (a draft model's forward over the
    # text since it last proposed: a prompt, or what came during a pause in drafting):
    # work a steady proposal does not do, left out of the price of a draft.
    propose_steady: bool = True
    # req_id -> per sampled token: (top token ids, their logprobs, rank of the sampled token,
    # logprob of the sampled token); None unless the request asked for logprobs.
    logprobs: dict[str, list[tuple[list[int], list[float], int, float]]] = field(
        default_factory=dict)
    # req_id -> (prompt index of the first token scored, per scored prompt token: top ids,
    # their logprobs, its rank, its logprob); only for requests that asked, per chunk.
    prompt_logprobs: dict[str, tuple[int, list[tuple[list[int], list[float], int, float]]]] = (
        field(default_factory=dict))
    # The KV connector's worker half: loads written or failed, pulls served (None: none).
    kv_report: KVWorkerReport | None = None
    # Multi-LoRA: adapters whose ordered load finished since the last report, and those
    # whose load failed (id -> why).
    lora_loaded: list[int] = field(default_factory=list)
    lora_failed: dict[int, str] = field(default_factory=dict)
    # Structured outputs: the keys whose compile (ordered in
    # ``SchedulerOutput.grammar_compiles``) finished since the last step, and those whose
    # compile failed, with why. Each order is reported once.
    grammars_ready: list[str] = field(default_factory=list)
    grammar_errors: dict[str, str] = field(default_factory=dict)


@dataclass
class RequestUpdate:
    """What one step did to one request, for the engine's output processing."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[tuple[list[int], list[float], int, float]] | None = None
    # With its first token: the prompt's logprobs, if it asked (entry i: prompt token i + 1).
    prompt_logprobs: list[tuple[list[int], list[float], int, float]] | None = None
    status: RequestStatus = RequestStatus.RUNNING
    stop_reason: int | str | None = None
    # The request itself (the engine core reads its counters and times into its output).
    request: Request | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.status.is_finished
