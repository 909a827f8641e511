"""A policy whose waiting order is a key computed when a request (re)joins the queue."""

from __future__ import annotations

import abc
from collections.abc import Iterable
from typing import Any

from conveyor.config import PolicyConfig
from conveyor.core.policies.base import SchedulingPolicy
from conveyor.core.policies.queues import LazyHeap
from conveyor.request import Request


class KeyedPolicy(SchedulingPolicy):
    """Smallest key first; ties go to the request that joined the queue first.

    The key is fixed while a request waits, so the queue is a heap: O(log n) per
    add, requeue and peek (amortised), O(1) per removal.
    """

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self._queue: LazyHeap[Request] = LazyHeap()

    @abc.abstractmethod
    def key(self, request: Request, now: float) -> Any:
        """Order key of a request joining the queue at ``now`` (smaller goes first)."""

    def add(self, request: Request, now: float) -> None:
        self._queue.push(request.request_id, self.key(request, now), request)

    def requeue(self, request: Request, now: float) -> None:
        self._queue.push(request.request_id, self.key(request, now), request)

    def peek(self, now: float) -> Request | None:
        top = self._queue.peek()
        return top[1] if top is not None else None

    def pop(self, request: Request) -> None:
        self._queue.remove(request.request_id)

    def __len__(self) -> int:
        return len(self._queue)

    def waiting(self) -> Iterable[Request]:
        return iter(self._queue)
