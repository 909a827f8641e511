"""Earliest deadline first on per-request TTFT / TPOT targets."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

from conveyor.config import PolicyConfig
from conveyor.core.policies.base import SchedulingPolicy, register_policy
from conveyor.core.policies.queues import LazyHeap
from conveyor.request import Request


@register_policy
class EDFPolicy(SchedulingPolicy):
    """The request whose next token is due first goes first.

    A request's next deadline, from its targets (``slo_ttft_s`` / ``slo_tpot_s``, or the
    ``default_slo_*`` of the config):

        no token yet          arrival + ttft
        k tokens already      first_token_time + k * tpot   (the mean-TPOT target; only a
                              preempted request waits with tokens)

    Waiting requests fall into three classes, served in this order:

        on time      deadline >= now, earliest deadline first
        late         deadline <  now (it can no longer meet its target), earliest first
        best effort  no target at all, arrival order

    so requests that can still meet their targets are preferred, a late one is still
    served before best-effort traffic, and with no targets anywhere EDF is FCFS.
    Time only moves forward, so a waiting request turns late at most once: ``peek``
    moves the expired heads of the on-time heap to the late heap, and every operation
    is O(log n) amortised.

    EDF here never preempts to admit (preempting costs the victim its KV and its own
    deadline); when a running request needs a block, the one with the most slack (no
    target first, then the latest next deadline) is the victim. Running requests get
    the token budget earliest deadline first.
    """

    name = "edf"

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self._on_time: LazyHeap[Request] = LazyHeap()
        self._late: LazyHeap[Request] = LazyHeap()
        self._best_effort: LazyHeap[Request] = LazyHeap()
        self.num_admitted_late = 0
        self.num_admitted_on_time = 0

    def deadline(self, request: Request) -> float | None:
        """When the request's next token is due on the engine's clock, or None."""
        ttft = request.slo_ttft_s if request.slo_ttft_s is not None \
            else self.config.default_slo_ttft_s
        tpot = request.slo_tpot_s if request.slo_tpot_s is not None \
            else self.config.default_slo_tpot_s
        k = request.num_output_tokens
        if k > 0 and tpot is not None and request.first_token_time is not None:
            return request.first_token_time + k * tpot
        if ttft is not None:
            return request.arrival_time + ttft
        return None

    # ---- the waiting queue ---------------------------------------------------------------
    def add(self, request: Request, now: float) -> None:
        rid = request.request_id
        deadline = self.deadline(request)
        if deadline is None:
            self._best_effort.push(rid, request.arrival_time, request)
        elif deadline < now:
            self._late.push(rid, (deadline, request.arrival_time), request)
        else:
            self._on_time.push(rid, (deadline, request.arrival_time), request)

    def requeue(self, request: Request, now: float) -> None:
        self.add(request, now)

    def peek(self, now: float) -> Request | None:
        while (top := self._on_time.peek()) is not None and top[0][0] < now:
            key, request = top
            self._on_time.remove(request.request_id)
            self._late.push(request.request_id, key, request)
        for queue in (self._on_time, self._late, self._best_effort):
            top = queue.peek()
            if top is not None:
                return top[1]
        return None

    def pop(self, request: Request) -> None:
        rid = request.request_id
        for queue in (self._on_time, self._late, self._best_effort):
            if queue.remove(rid):
                return

    def __len__(self) -> int:
        return len(self._on_time) + len(self._late) + len(self._best_effort)

    def waiting(self) -> Iterable[Request]:
        def chain() -> Iterator[Request]:
            yield from self._on_time
            yield from self._late
            yield from self._best_effort
        return chain()

    # ---- running and preemption ----------------------------------------------------------
    def _due(self, request: Request) -> float:
        deadline = self.deadline(request)
        return math.inf if deadline is None else deadline

    def order_running(self, running: list[Request]) -> list[Request]:
        return sorted(running, key=self._due)

    def select_victim(self, running: list[Request], requester: Request) -> Request | None:
        return max(running, key=lambda r: (self._due(r), r.admitted_seq), default=None)

    def on_admitted(self, request: Request, now: float) -> None:
        deadline = self.deadline(request)
        if deadline is not None:
            if deadline < now:
                self.num_admitted_late += 1
            else:
                self.num_admitted_on_time += 1

    def stats(self) -> dict[str, Any]:
        return {"num_admitted_on_time": self.num_admitted_on_time,
                "num_admitted_late": self.num_admitted_late}
