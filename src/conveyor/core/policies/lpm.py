"""Longest prefix match first: cache-aware admission within a bounded window."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from conveyor.config import PolicyConfig
from conveyor.core.policies.base import SchedulingPolicy, register_policy
from conveyor.core.policies.queues import FifoQueue
from conveyor.request import Request


@register_policy
class LPMPolicy(SchedulingPolicy):
    """Among the ``lpm_window`` oldest waiting requests, the one with the most prompt
    tokens in the prefix cache goes first (ties: the oldest), as SGLang's cache-aware
    policy does: a cached prefix is used while it is still cached instead of being
    evicted by the requests ahead of it. With no hits anywhere this is FCFS.

    Starvation bound: a waiting request is overtaken (a request behind it in the
    queue is admitted first) at most ``lpm_window`` times; when any request in the
    window has reached that count, the oldest such goes next. A request outside the
    window cannot be overtaken at all (everything behind it is outside too). A
    preempted request rejoins at the front, as in FCFS.

    The policy never sees the KV manager: the scheduler's ``cached_prefix_tokens``
    answers for one request. Cost per ``peek``: O(window) such lookups (each a few
    dictionary probes, one per cached block); O(window) per admission for the
    overtake counts; O(1) for add, requeue and removal.
    """

    name = "lpm"

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self._queue = FifoQueue()
        self._order: dict[str, int] = {}  # queue position: front pushes count down
        self._overtaken: dict[str, int] = {}
        self._back = itertools.count()
        self._front = itertools.count(-1, -1)
        # Set aside by the scheduler for this step: still queued in place, not offered.
        self._hidden: set[str] = set()
        self.num_forced = 0  # admissions forced by the overtake bound
        self.num_reordered = 0  # admissions that overtook an older request

    def add(self, request: Request, now: float) -> None:
        self._queue.append(request)
        self._order[request.request_id] = next(self._back)
        self._overtaken[request.request_id] = 0

    def requeue(self, request: Request, now: float) -> None:
        self._queue.push_front(request)
        self._order[request.request_id] = next(self._front)
        self._overtaken[request.request_id] = 0

    def _window(self) -> list[Request]:
        queue = self._queue
        if self._hidden:
            queue = (r for r in self._queue if r.request_id not in self._hidden)
        return list(itertools.islice(queue, self.config.lpm_window))

    def set_aside(self, request: Request) -> None:
        # Kept in its place (set aside requests come from anywhere in the window, so
        # pushing them back to the front would reorder the queue) and with its count.
        self._hidden.add(request.request_id)

    def restore_set_aside(self, requests: list[Request], now: float) -> None:
        self._hidden.clear()

    def peek(self, now: float) -> Request | None:
        window = self._window()
        if not window:
            return None
        limit = self.config.lpm_window
        for request in window:
            if self._overtaken[request.request_id] >= limit:
                return request
        cached = self.context.cached_prefix_tokens
        best, best_hit = window[0], cached(window[0])
        for request in window[1:]:
            hit = cached(request)
            if hit > best_hit:
                best, best_hit = request, hit
        return best

    def pop(self, request: Request) -> None:
        # The bookkeeping goes in on_admitted / on_finished, which follow every pop.
        self._queue.remove(request)
        self._hidden.discard(request.request_id)

    def on_admitted(self, request: Request, now: float) -> None:
        rid = request.request_id
        position = self._order.pop(rid, None)
        if self._overtaken.pop(rid, 0) >= self.config.lpm_window:
            self.num_forced += 1
        if position is None:
            return
        overtook = False
        for older in self._window():
            if self._order[older.request_id] > position:
                break  # the queue is in position order: the rest are younger
            overtook = True
            self._overtaken[older.request_id] += 1
        self.num_reordered += overtook

    def on_finished(self, request: Request) -> None:
        self._order.pop(request.request_id, None)
        self._overtaken.pop(request.request_id, None)

    def __len__(self) -> int:
        return len(self._queue)

    def waiting(self) -> Iterable[Request]:
        return iter(self._queue)

    def stats(self) -> dict[str, Any]:
        return {"num_reordered": self.num_reordered, "num_forced": self.num_forced}
