"""Results returned to users, shaped like vLLM's ``RequestOutput``.

Below the engine: the engine's messages reach ``RequestMetrics`` through the two
protocols here (``engine/messages.py``'s ``EngineCoreRequest`` and ``EngineCoreOutput``
have these fields), so this module imports nothing of the engine.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol


class CoreRequestView(Protocol):
    """What the metrics read of a request the engine core was given."""

    request_id: str
    arrival_time: float
    prompt_token_ids: list[int]
    priority: int
    tenant: str

    def slo_targets_s(self, default_ttft_s: float | None, default_tpot_s: float | None
                      ) -> tuple[float | None, float | None]: ...


class CoreOutputView(Protocol):
    """What the metrics read of the core's per-request output, besides its tokens."""

    num_cached_tokens: int
    num_preemptions: int
    first_scheduled_time: float | None
    finished_time: float | None


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token and the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Per-request timings on the engine's clock (seconds) and counters."""

    arrival_time: float
    # The scheduler's request id (a parent's id, or "<parent>#<k>" for sample k of n > 1).
    request_id: str = ""
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    # Time of every generated token, for inter-token latency.
    token_times: list[float] = field(default_factory=list, repr=False)
    priority: int = 0
    tenant: str = "default"
    # The request's targets (its own or the server's defaults), None when it has none.
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None

    # ---- recording (shared by the front end's output processor and the simulator) -------
    @classmethod
    def for_core_request(cls, req: CoreRequestView, default_slo_ttft_s: float | None,
                         default_slo_tpot_s: float | None) -> RequestMetrics:
        """Metrics for a request the core was given, with its effective targets."""
        slo_ttft_s, slo_tpot_s = req.slo_targets_s(default_slo_ttft_s, default_slo_tpot_s)
        return cls(arrival_time=req.arrival_time, request_id=req.request_id,
                   num_prompt_tokens=len(req.prompt_token_ids), priority=req.priority,
                   tenant=req.tenant, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)

    def record_tokens(self, num_tokens: int, now: float) -> None:
        """``num_tokens`` generated tokens delivered at ``now``."""
        self.token_times.extend([now] * num_tokens)

    def observe(self, out: CoreOutputView) -> None:
        """What the core reports of the request besides its tokens."""
        self.num_cached_tokens = out.num_cached_tokens
        self.num_preemptions = out.num_preemptions
        if out.first_scheduled_time is not None:
            self.first_scheduled_time = out.first_scheduled_time
        if out.finished_time is not None:
            self.finished_time = out.finished_time

    def finalize(self, finish_reason: str | None, now: float) -> None:
        """The request ended (``now`` if the core gave it no finish time)."""
        self.first_token_time = self.token_times[0] if self.token_times else None
        self.last_token_time = self.token_times[-1] if self.token_times else None
        if self.finished_time is None:
            self.finished_time = now
        self.num_generation_tokens = len(self.token_times)
        self.finish_reason = finish_reason

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.num_generation_tokens < 2 or self.first_token_time is None \
                or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)

    @property
    def slo_attained(self) -> bool | None:
        """Whether the request met its TTFT and TPOT targets (None: it has no target)."""
        if self.slo_ttft_s is None and self.slo_tpot_s is None:
            return None
        if self.finish_reason == "abort" or self.first_token_time is None:
            return False
        if self.slo_ttft_s is not None and self.ttft > self.slo_ttft_s:
            return False
        tpot = self.tpot
        return not (self.slo_tpot_s is not None and tpot is not None and tpot > self.slo_tpot_s)

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: None for the first prompt token, then one dict per
    # prompt token (the token and its top alternatives), as vLLM lays them out.
    prompt_logprobs: PromptLogprobs | None = None
