"""First come, first served."""

from __future__ import annotations

from collections.abc import Iterable

from conveyor.config import PolicyConfig
from conveyor.core.policies.base import SchedulingPolicy, register_policy
from conveyor.core.policies.queues import FifoQueue
from conveyor.request import Request


@register_policy
class FCFSPolicy(SchedulingPolicy):
    """Arrival order; a preempted request goes back to the front of the queue (as vLLM).

    Every operation is O(1).
    """

    name = "fcfs"

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self._queue = FifoQueue()

    def add(self, request: Request, now: float) -> None:
        self._queue.append(request)

    def requeue(self, request: Request, now: float) -> None:
        self._queue.push_front(request)

    def peek(self, now: float) -> Request | None:
        return self._queue.first()

    def pop(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def waiting(self) -> Iterable[Request]:
        return iter(self._queue)
