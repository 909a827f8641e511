"""Scheduling policies: strategy objects behind one protocol, registered by name.

A policy owns the waiting queue's order and picks preemption victims; the
scheduler's budget loop around it is the same for every policy:

    while the policy offers a waiting request (``peek``) and there is room:
        admit it (``pop``), or stop at the first that does not fit.

Policies see requests, the engine's clock (passed in) and nothing else.
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

from conveyor.request import Request


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs every policy may read; each policy reads only its own."""

    sjf_aging_s: float = 0.0
    fair_input_weight: float = 1.0
    fair_output_weight: float = 2.0
    tenant_weights: tuple[tuple[str, float], ...] = ()
    default_slo_ttft_s: float | None = None
    default_slo_tpot_s: float | None = None
    lpm_window: int = 64


class SchedulingPolicy(abc.ABC):
    name: ClassVar[str]

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()

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
        """Remove an admitted (or aborted) request from the waiting queue."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def waiting(self) -> Iterable[Request]:
        """Every waiting request, in no particular order."""

    # ---- preemption ----------------------------------------------------------------------
    def select_victim(self, running: list[Request], requester: Request) -> Request | None:
        """Running request to preempt so that ``requester`` (a running one) can grow.

        Default: the most recently admitted request, as vLLM does for FCFS.
        Requests listed as protected by the scheduler are already filtered out.
        """
        return max(running, key=lambda r: r.admitted_seq, default=None)

    def victim_for_waiting(self, running: list[Request], candidate: Request) -> Request | None:
        """Running request to preempt so that a waiting ``candidate`` gets room (None: wait)."""
        return None

    # ---- accounting hooks ----------------------------------------------------------------
    def on_scheduled(self, request: Request, num_tokens: int, now: float) -> None:
        """Called for every request in a step's batch with the tokens it computes."""

    def on_tokens_generated(self, request: Request, num_tokens: int) -> None:
        """Called after a step with the output tokens a request gained."""

    def on_finished(self, request: Request) -> None:
        """Called once when a request leaves the system."""


class FCFSPolicy(SchedulingPolicy):
    """Arrival order; a preempted request goes back to the front of the queue."""

    name = "fcfs"

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self._queue: deque[Request] = deque()

    def add(self, request: Request, now: float) -> None:
        self._queue.append(request)

    def requeue(self, request: Request, now: float) -> None:
        self._queue.appendleft(request)

    def peek(self, now: float) -> Request | None:
        return self._queue[0] if self._queue else None

    def pop(self, request: Request) -> None:
        if self._queue and self._queue[0] is request:
            self._queue.popleft()
        else:
            self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def waiting(self) -> Iterable[Request]:
        return self._queue


POLICIES: dict[str, Callable[[PolicyConfig], SchedulingPolicy]] = {}


def register_policy(cls: type[SchedulingPolicy]) -> type[SchedulingPolicy]:
    POLICIES[cls.name] = cls
    return cls


register_policy(FCFSPolicy)


def make_policy(name: str, config: PolicyConfig | None = None) -> SchedulingPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; valid policies: "
                         f"{', '.join(sorted(POLICIES))}") from None
    return factory(config or PolicyConfig())
