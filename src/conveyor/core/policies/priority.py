"""Strict priority classes (lower value is more urgent, as in vLLM), FCFS within a class."""

from __future__ import annotations

from conveyor.core.policies.base import register_policy
from conveyor.core.policies.keyed import KeyedPolicy
from conveyor.request import Request


def _urgency(request: Request) -> tuple[int, float, int]:
    """Sorts most urgent first: class, then arrival, then admission."""
    return (request.priority, request.arrival_time, request.admitted_seq)


@register_policy
class PriorityPolicy(KeyedPolicy):
    """Waiting order ``(priority, arrival)``; a preempted request keeps its place.

    Preemption: when a more urgent request waits and there is no room (no sequence
    slot, no token budget or no KV blocks), the least urgent running requests
    that are *strictly* less urgent are preempted until it fits (the scheduler
    preempts nobody if even that would not make room). When a running request
    needs a block, the least urgent running request (latest arrival within its
    class) is the victim. Running requests get the token budget most urgent first.
    Together: once room exists, a more urgent waiting request is admitted in
    the same step; inversion lasts at most until the step that has room. A running
    long prefill keeps no reserved share against a more urgent waiting request: it
    pauses (computed blocks kept, nothing recomputed) while such requests take the step.
    """

    name = "priority"

    def key(self, request: Request, now: float) -> tuple[int, float]:
        return (request.priority, request.arrival_time)

    def order_running(self, running: list[Request]) -> list[Request]:
        return sorted(running, key=_urgency)

    def outranks_long_prefill(self, waiting: Request, running: Request) -> bool:
        # A more urgent arrival pauses a long prefill (its blocks stay) instead of sharing.
        return waiting.priority < running.priority

    def select_victim(self, running: list[Request], requester: Request) -> Request | None:
        return max(running, key=_urgency, default=None)

    def victim_for_waiting(self, running: list[Request], candidate: Request) -> Request | None:
        victim = max(running, key=_urgency, default=None)
        if victim is None or victim.priority <= candidate.priority:
            return None
        return victim
