"""The policy protocol, its configuration and the registry of policies by name.

A policy owns the waiting queue's order and picks preemption victims; the
scheduler's budget loop around it is the same for every policy:

    serve running requests (in ``order_running``'s order) under the token budget
    while the policy offers a waiting request (``peek``):
        admit it if it fits (``pop``, ``on_admitted``),
        else preempt the victims ``victim_for_waiting`` names until it fits,
        else stop (head-of-line: the policy's order is never bypassed)

Policies see requests, the engine's clock (passed in) and what the scheduler
hands them through a ``PolicyContext``; never the KV manager, never a tensor.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from conveyor.core.policies.predictors import PREDICTORS
from conveyor.request import Request


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs every policy may read; each policy reads only its own."""

    # sjf: a request is never overtaken by one that arrived this much later (0: no aging).
    sjf_aging_s: float = 0.0
    # sjf: how the expected output length is predicted (a name in ``PREDICTORS``).
    sjf_predictor: str = "hint"
    # sjf: cost of a token still to prefill relative to an output token still to generate.
    sjf_prompt_weight: float = 1.0
    # fair: service counted as input_weight * prompt tokens + output_weight * output tokens.
    fair_input_weight: float = 1.0
    fair_output_weight: float = 2.0
    # fair: preempt to admit a waiting request when the running request's tenant has been
    # served more than this many weighted tokens beyond the waiting one's (None: never).
    fair_preempt_gap: float | None = 0.0
    # fair: a tenant joining the backlog may start this many weighted tokens below the
    # backlogged minimum (0: plain VTC lift), so a tenant that was idle goes first.
    fair_rejoin_credit: float = 2048.0
    # fair: (tenant, weight) pairs; a tenant of weight 2 gets twice the service of weight 1.
    tenant_weights: tuple[tuple[str, float], ...] = ()
    # edf: targets for requests that carry none.
    default_slo_ttft_s: float | None = None
    default_slo_tpot_s: float | None = None
    # lpm: how many of the oldest waiting requests are compared, and how many later
    # requests may overtake any one request.
    lpm_window: int = 64
    # slo: a waiting request that can no longer meet its TTFT target is served after the
    # on-time ones ("serve") or rejected early ("reject", HTTP 429 slo_unattainable).
    slo_late_action: str = "serve"
    # slo: among on-time requests whose latest start times fall in one window of
    # slo_tie_quantum_s, the least served tenant (VTC counter) goes first ("fair"), or the
    # earliest latest start ("slack").
    slo_tie_break: str = "slack"
    slo_tie_quantum_s: float = 0.05

    def __post_init__(self) -> None:
        _check(self.sjf_aging_s >= 0 and math.isfinite(self.sjf_aging_s), "sjf_aging_s",
               f"must be a finite number >= 0, got {self.sjf_aging_s}")
        _check(self.sjf_predictor in PREDICTORS, "sjf_predictor",
               f"must be one of {', '.join(sorted(PREDICTORS))}, got {self.sjf_predictor!r}")
        _check(self.sjf_prompt_weight >= 0 and math.isfinite(self.sjf_prompt_weight),
               "sjf_prompt_weight", f"must be a finite number >= 0, got {self.sjf_prompt_weight}")
        _check(self.fair_input_weight >= 0, "fair_input_weight",
               f"must be >= 0, got {self.fair_input_weight}")
        _check(self.fair_output_weight >= 0, "fair_output_weight",
               f"must be >= 0, got {self.fair_output_weight}")
        _check(self.fair_input_weight + self.fair_output_weight > 0, "fair_input_weight",
               "and fair_output_weight may not both be 0")
        if self.fair_preempt_gap is not None:
            _check(self.fair_preempt_gap >= 0 and math.isfinite(self.fair_preempt_gap),
                   "fair_preempt_gap", f"must be a finite number >= 0 or None, got "
                   f"{self.fair_preempt_gap}")
        _check(self.fair_rejoin_credit >= 0 and math.isfinite(self.fair_rejoin_credit),
               "fair_rejoin_credit", f"must be a finite number >= 0, got "
               f"{self.fair_rejoin_credit}")
        for tenant, weight in self.tenant_weights:
            _check(weight > 0 and math.isfinite(weight), "tenant_weights",
                   f"must be finite and > 0, got {weight} for tenant {tenant!r}")
        for name in ("default_slo_ttft_s", "default_slo_tpot_s"):
            value = getattr(self, name)
            if value is not None:
                _check(value > 0, name, f"must be > 0, got {value}")
        _check(isinstance(self.lpm_window, int) and self.lpm_window >= 1, "lpm_window",
               f"must be an integer >= 1, got {self.lpm_window}")
        _check(self.slo_late_action in ("serve", "reject"), "slo_late_action",
               f"must be 'serve' or 'reject', got {self.slo_late_action!r}")
        _check(self.slo_tie_break in ("slack", "fair"), "slo_tie_break",
               f"must be 'slack' or 'fair', got {self.slo_tie_break!r}")
        _check(self.slo_tie_quantum_s > 0 and math.isfinite(self.slo_tie_quantum_s),
               "slo_tie_quantum_s", f"must be a finite number > 0, got "
               f"{self.slo_tie_quantum_s}")


def _no_cache(request: Request) -> int:
    return 0


@dataclass(frozen=True)
class PolicyContext:
    """What the scheduler lets a policy know beyond the requests themselves."""

    # Longest prompt any request may have plus its max_tokens (sjf normalises work by it).
    max_model_len: int | None = None
    # Prompt tokens of a waiting request that the prefix cache holds right now.
    cached_prefix_tokens: Callable[[Request], int] = _no_cache
    # Least seconds to prefill (tokens, after start computed ones) alone, from the token
    # budget controller's step-cost model; None when the scheduler has none.
    predict_prefill_s: Callable[[int, int], float] | None = None


class SchedulingPolicy(abc.ABC):
    name: ClassVar[str]

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self.context = PolicyContext()

    def bind(self, context: PolicyContext) -> None:
        """The scheduler hands over its context once, before the first request."""
        self.context = context

    # ---- the waiting queue ---------------------------------------------------------------
    @abc.abstractmethod
    def add(self, request: Request, now: float) -> None:
        """A new arrival joins the waiting queue."""

    @abc.abstractmethod
    def requeue(self, request: Request, now: float) -> None:
        """A preempted request rejoins the waiting queue."""

    @abc.abstractmethod
    def peek(self, now: float) -> Request | None:
        """The waiting request to admit next, without removing it."""

    @abc.abstractmethod
    def pop(self, request: Request) -> None:
        """Remove a waiting request (admitted, aborted or rejected) from the queue."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def waiting(self) -> Iterable[Request]:
        """Every waiting request, in no particular order."""

    # ---- the running batch ---------------------------------------------------------------
    def order_running(self, running: list[Request]) -> list[Request]:
        """Order in which running requests get the step's token budget (default: admission)."""
        return running

    # ---- preemption ----------------------------------------------------------------------
    def select_victim(self, running: list[Request], requester: Request) -> Request | None:
        """Running request to preempt so that ``requester`` (a running one) can grow.

        ``running`` holds only requests the scheduler allows as victims (the preemption
        cap) and always ``requester`` itself. Default: the most recently admitted, as
        vLLM does for FCFS.
        """
        return max(running, key=lambda r: r.admitted_seq, default=None)

    def victim_for_waiting(self, running: list[Request], candidate: Request) -> Request | None:
        """Running request to preempt so that a waiting ``candidate`` gets room (None: wait).

        Called repeatedly, with the victims chosen so far removed from ``running``, until
        the candidate would fit; the scheduler preempts nobody unless it would.
        """
        return None

    def reject_waiting(self, now: float) -> list[Request]:
        """Waiting requests to reject now (still in the queue: the scheduler pops and
        finishes them, ``stop_reason`` "slo_unattainable"). Called once per step."""
        return []

    # ---- accounting hooks ----------------------------------------------------------------
    def on_admitted(self, request: Request, now: float) -> None:
        """Called when a waiting request joins the running batch (after ``pop``)."""

    def on_scheduled(self, request: Request, num_tokens: int, now: float) -> None:
        """Called for every request in a step's batch with the tokens it computes."""

    def on_tokens_generated(self, request: Request, num_tokens: int) -> None:
        """Called after a step with the output tokens a request gained."""

    def on_finished(self, request: Request) -> None:
        """Called once when a request leaves the system (finished, aborted, rejected)."""

    def stats(self) -> dict[str, Any]:
        """Policy-specific counters for ``LLM.stats()`` and benchmarks."""
        return {}


POLICIES: dict[str, Callable[[PolicyConfig], SchedulingPolicy]] = {}


def register_policy(cls: type[SchedulingPolicy]) -> type[SchedulingPolicy]:
    """Class decorator: make a policy available by its ``name``."""
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, config: PolicyConfig | None = None) -> SchedulingPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; valid policies: "
                         f"{', '.join(sorted(POLICIES))}") from None
    return factory(config or PolicyConfig())


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")
