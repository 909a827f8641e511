"""The typed messages between the front end and the engine core (no torch, no text).

    front end                                          engine core
    ---------                                          -----------
    AddRequests([EngineCoreRequest, ...])   ------->   validate, queue (all or none)
    AbortRequests(ids, reason)              ------->   finish them, free their blocks
    UtilityCall(call_id, UtilityMethod)     ------->   stats, free blocks, reset cache
    Shutdown()                              ------->   stop after the current step
                                            <-------   CoreReady(config)      (process only)
                                            <-------   AddResult(request_id, error)
                                            <-------   StepOutputs(EngineCoreOutputs)
                                            <-------   UtilityResult(call_id, ok, value)
                                            <-------   RequestsFailed(ids, error) (a step raised)
                                            <-------   CoreExit(error)

Only token ids cross: the front end owns the tokenizer, text, stop strings and n > 1
fan-out (each sample is its own ``EngineCoreRequest``). Every message is a msgspec
``Struct``, encoded as msgpack (``encoder``/``decoder``); no callable and no pickle
crosses the process boundary. Errors cross as an ``ErrorInfo`` (a kind and a message)
and are rebuilt on the other side as the same exception types.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from conveyor.config import EngineConfig
from conveyor.config.lora import LoRARequest
from conveyor.kv_transfer.messages import KVTransferParams
from conveyor.sampling_params import SamplingParams


class QueueFullError(RuntimeError):
    """Admission control refused a request (the waiting queue is at max_queue_len)."""


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence for the core to generate: token ids and parameters, no text."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    tenant: str = "default"
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # Prefill/decode disaggregation: this request's role in a KV transfer (None: none).
    kv_transfer_params: KVTransferParams | None = None
    # Multi-LoRA: the adapter it runs with (None: the base model).
    lora_request: LoRARequest | None = None

    def slo_targets_s(self, default_ttft_s: float | None, default_tpot_s: float | None
                      ) -> tuple[float | None, float | None]:
        """(TTFT, TPOT) targets in seconds: the request's own, else the defaults. The one
        rule for the core's request and the front end's (and simulator's) metrics."""
        return (self.slo_ttft_ms / 1e3 if self.slo_ttft_ms is not None else default_ttft_s,
                self.slo_tpot_ms / 1e3 if self.slo_tpot_ms is not None else default_tpot_s)


# Per sampled token: (top token ids, their logprobs, rank of the sampled token, its logprob).
TokenLogprobs = tuple[list[int], list[float], int, float]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one step (or an abort) did to one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"; None while it runs
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # the core's clock
    finished_time: float | None = None
    # With the first token of a request that asked: its prompt's logprobs (entry i scores
    # prompt token i + 1; the first prompt token has none).
    prompt_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """A step's outputs; ``timestamp`` (the core's clock at the update) stamps every new
    token. ``scheduled``: whether the step ran anything (False: requests wait for room)."""

    outputs: list[EngineCoreOutput]
    timestamp: float
    scheduled: bool = True


class UtilityMethod(enum.Enum):
    STATS = "stats"  # EngineCore.stats()
    NUM_FREE_BLOCKS = "num_free_blocks"
    RESET_PREFIX_CACHE = "reset_prefix_cache"
    HAS_UNFINISHED = "has_unfinished"
    CHECK_INVARIANTS = "check_invariants"  # raise if the scheduler's or pool's are broken
    # What a router reads: cached block hashes (at most ``args[0]``) and the load.
    KV_SUMMARY = "kv_summary"
    # The loop's: stop stepping after ``args[0]`` more steps (default 0), and go on again
    # (as vLLM's pause_generation). Commands are still served while paused.
    PAUSE = "pause"
    RESUME = "resume"


class ErrorInfo(msgspec.Struct, array_like=True):
    """An exception as it crosses: ``kind`` picks the type rebuilt on the other side."""

    kind: str  # "invalid" (ValueError) | "queue_full" | "error"
    message: str

    @classmethod
    def of(cls, e: BaseException) -> ErrorInfo:
        if isinstance(e, QueueFullError):
            return cls("queue_full", str(e))
        if isinstance(e, ValueError):
            return cls("invalid", str(e))
        return cls("error", f"{type(e).__name__}: {e}")

    def rebuild(self) -> BaseException:
        if self.kind == "queue_full":
            return QueueFullError(self.message)
        if self.kind == "invalid":
            return ValueError(self.message)
        return RuntimeError(self.message)


# ---- front end -> core ---------------------------------------------------------------------
class AddRequests(msgspec.Struct, tag=True, array_like=True):
    """Requests added together (the samples of one n > 1 request): all or none."""

    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    """Finish requests wherever they are. ``reason`` "stop" is a stop string the front end
    found (``stop_reason`` is that string); "abort" is a client leaving or a timeout."""

    request_ids: list[str]
    reason: str = "abort"
    stop_reason: str | None = None


class UtilityCall(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    method: UtilityMethod
    args: list[int] = []


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


CoreCommand = AddRequests | AbortRequests | UtilityCall | Shutdown


# ---- core -> front end ---------------------------------------------------------------------
class CoreReady(msgspec.Struct, tag=True, array_like=True):
    config: EngineConfig


class CoreStartFailed(msgspec.Struct, tag=True, array_like=True):
    message: str


class AddResult(msgspec.Struct, tag=True, array_like=True):
    """The answer to an ``AddRequests``, under its first request's id; error None: queued."""

    request_id: str
    error: ErrorInfo | None = None


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    outputs: EngineCoreOutputs


class UtilityResult(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    ok: bool
    value: Any = None
    error: ErrorInfo | None = None


class RequestsFailed(msgspec.Struct, tag=True, array_like=True):
    """A step raised: these core requests were aborted and fail with ``error``."""

    request_ids: list[str]
    error: ErrorInfo


class CoreExit(msgspec.Struct, tag=True, array_like=True):
    """The core's loop ended: ``error`` None after a Shutdown, else why it died."""

    error: str | None = None


CoreMessage = (CoreReady | CoreStartFailed | AddResult | StepOutputs | UtilityResult
               | RequestsFailed | CoreExit)


def encoder() -> msgspec.msgpack.Encoder:
    """msgpack of the Structs above; anything else (a callable) is a TypeError."""
    return msgspec.msgpack.Encoder()


def command_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(list[CoreCommand])


def core_message_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(CoreMessage)
