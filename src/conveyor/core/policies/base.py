"""The policy protocol and the registry of policies by name (their knobs, ``PolicyConfig``,
live in config/policy.py).

A policy owns the waiting queue's order and picks preemption victims; the
scheduler's budget loop around it is the same for every policy:

    serve running decodes, then running short prefills (in ``order_running``'s order)
    while the policy offers a waiting request (``peek``):
        admit it if it fits (``pop``, ``on_admitted``),
        else preempt the victims ``victim_for_waiting`` names until it fits,
        else stop (head-of-line: the policy's order is never bypassed)
    the running long prefills take the rest, at least their reserved share
    (core/prefill_split.py; ``outranks_long_prefill`` may waive it)

Policies see requests, the engine's clock (passed in) and what the scheduler
hands them through a ``PolicyContext``; never the KV manager, never a tensor.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from conveyor.config.names import POLICY_NAMES
from conveyor.config.policy import PolicyConfig
from conveyor.request import Request


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

    def set_aside(self, request: Request) -> None:
        """The scheduler passes over waiting ``request`` for the rest of this step (``peek``
        must not offer it again); ``restore_set_aside`` follows before the step ends.
        Default: out of the queue, back at the front (right for orders that only ever
        offer their front, or whose key is fixed)."""
        self.pop(request)

    def restore_set_aside(self, requests: list[Request], now: float) -> None:
        """The step's set-aside requests, in the order they were set aside, back where
        they were in the queue."""
        for request in reversed(requests):
            self.requeue(request, now)

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def waiting(self) -> Iterable[Request]:
        """Every waiting request, in no particular order."""

    # ---- the running batch ---------------------------------------------------------------
    def order_running(self, running: list[Request]) -> list[Request]:
        """Order in which running requests get the step's token budget (default: admission)."""
        return running

    def outranks_long_prefill(self, waiting: Request, running: Request) -> bool:
        """Whether ``waiting`` may take a running long prefill's reserved share of a step
        (core/prefill_split.py): the long prefill then pauses, keeping its blocks, while
        such requests wait. Default: never (the share bounds every long prompt's TTFT)."""
        return False

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
    POLICY_NAMES.add(cls.name)  # the config validates against these names
    return cls


def make_policy(name: str, config: PolicyConfig | None = None) -> SchedulingPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; valid policies: "
                         f"{', '.join(sorted(POLICIES))}") from None
    return factory(config or PolicyConfig())
