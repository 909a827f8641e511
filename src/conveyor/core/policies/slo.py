"""SLO-driven scheduling: TTFT slack order, a stated action for lost requests, and the
per-step token budget controller (``core/budget.py``) that protects TPOT."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from conveyor.config import PolicyConfig
from conveyor.core.policies.base import SchedulingPolicy, register_policy
from conveyor.core.policies.queues import LazyHeap
from conveyor.request import Request, RequestStatus

_RUNNING = RequestStatus.RUNNING
_REJECTED = RequestStatus.FINISHED_REJECTED


class _SlackQueue:
    """On-time waiting requests by latest start time (O(log n) per operation).

    With ``quantum`` (the fair tie-break), requests whose latest starts fall in the same
    window of ``quantum`` seconds count as tied, and the tenant with the smallest
    ``counter`` goes first among them (its most urgent request); windows go in order.
    """

    def __init__(self, quantum: float | None, counter: Callable[[str], float]) -> None:
        self._quantum = quantum
        self._counter = counter
        self._heap: LazyHeap[Request] = LazyHeap()  # no tie-break: (latest start, arrival)
        self._buckets: dict[int, dict[str, LazyHeap[Request]]] = {}
        self._bucket_ids: LazyHeap[int] = LazyHeap()
        self._where: dict[str, tuple[int, str]] = {}

    def push(self, request: Request, key: float) -> None:
        rid = request.request_id
        if self._quantum is None:
            self._heap.push(rid, (key, request.arrival_time), request)
            return
        bucket = math.floor(key / self._quantum)
        tenants = self._buckets.setdefault(bucket, {})
        if not tenants:
            self._bucket_ids.push(bucket, bucket, bucket)
        tenants.setdefault(request.tenant, LazyHeap()).push(
            rid, (key, request.arrival_time), request)
        self._where[rid] = (bucket, request.tenant)

    def remove(self, rid: str) -> bool:
        if self._quantum is None:
            return self._heap.remove(rid)
        where = self._where.pop(rid, None)
        if where is None:
            return False
        bucket, tenant = where
        tenants = self._buckets[bucket]
        tenants[tenant].remove(rid)
        if not tenants[tenant]:
            del tenants[tenant]
        if not tenants:
            del self._buckets[bucket]
            self._bucket_ids.remove(bucket)
        return True

    def peek_min(self) -> tuple[float, Request] | None:
        """The request with the earliest latest start, and that time."""
        if self._quantum is None:
            top = self._heap.peek()
            return None if top is None else (top[0][0], top[1])
        top = self._bucket_ids.peek()
        if top is None:
            return None
        heads = [h.peek() for h in self._buckets[top[1]].values()]
        key, request = min((h for h in heads if h is not None), key=lambda h: h[0])
        return key[0], request

    def first(self) -> Request | None:
        """The request to admit next: the earliest latest start, or with the fair
        tie-break the least served tenant's most urgent one in the earliest window."""
        if self._quantum is None:
            top = self._heap.peek()
            return None if top is None else top[1]
        top = self._bucket_ids.peek()
        if top is None:
            return None
        best = None
        for tenant, heap in self._buckets[top[1]].items():
            head = heap.peek()
            if head is not None:
                rank = (self._counter(tenant), head[0])
                if best is None or rank < best[0]:
                    best = (rank, head[1])
        return None if best is None else best[1]

    def __len__(self) -> int:
        return len(self._heap) if self._quantum is None else len(self._where)

    def __iter__(self) -> Iterator[Request]:
        if self._quantum is None:
            yield from self._heap
            return
        for tenants in self._buckets.values():
            for heap in tenants.values():
                yield from heap


@register_policy
class SLOPolicy(SchedulingPolicy):
    """Serve the request with the least TTFT slack first; protect TPOT with the budget.

    A request's next token is due (as for ``edf``) at ``arrival + ttft`` for its first
    token and ``first_token_time + k * tpot`` for token k+1. Its **latest start** is that
    deadline minus the least time its remaining prefill takes alone (the budget
    controller's cost model, in chunks of the ceiling; 0 without a model): slack =
    latest start - now, and ordering by latest start is ordering by slack, with a key
    that stays fixed while the request waits.

    Waiting requests, in this order:

        on time      latest start >= now, least slack first (fair tie-break: see below)
        late         it can no longer meet its target even alone: ``slo_late_action``
                     "serve" keeps it, served after every on-time request (arrival
                     order); "reject" rejects it at once if it never ran (finish reason
                     abort, stop_reason "slo_unattainable", HTTP 429 on the server); a
                     preempted request, which already streamed, is served late instead
        best effort  no target: arrival order

    With ``slo_tie_break`` "fair", on-time requests whose latest starts fall in one
    window of ``slo_tie_quantum_s`` are tied and the tenant with the smallest Virtual
    Token Counter goes first (input tokens at admission, output tokens as generated,
    ``fair_*_weight`` and ``tenant_weights`` as for ``fair``; a tenant that starts
    waiting is lifted to the least backlogged counter, VTC's rule). Urgency still wins
    across windows.

    Running requests get the step first as decodes (one token each, never stalled),
    then prefill chunks by latest start (recomputed for what is left), on time before
    late. How big those chunks may be is the budget controller's decision (the
    scheduler runs it for this policy when given a step-cost model). Never preempts to
    admit; when a running request needs a block, the one with the most slack goes (no
    target first, then the latest next deadline), as for ``edf``.
    """

    name = "slo"

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        cfg = self.config
        self._weights = dict(cfg.tenant_weights)
        self.counters: dict[str, float] = {}
        self._waiting_of: dict[str, int] = {}  # tenant -> waiting requests (backlog)
        quantum = cfg.slo_tie_quantum_s if cfg.slo_tie_break == "fair" else None
        self._on_time = _SlackQueue(quantum, lambda t: self.counters.get(t, 0.0))
        self._late: LazyHeap[Request] = LazyHeap()
        self._best_effort: LazyHeap[Request] = LazyHeap()
        self._rejecting: dict[str, Request] = {}  # late, never ran: rejected next step
        self.num_admitted_on_time = 0
        self.num_admitted_late = 0
        self.num_rejected = 0
        self._now = -math.inf  # the current step's time (reject_waiting starts every step)

    # ---- deadlines -----------------------------------------------------------------------
    def deadline(self, request: Request) -> float | None:
        """When the request's next token is due on the engine's clock, or None."""
        k = request.num_output_tokens
        if k > 0 and request.slo_tpot_s is not None and request.first_token_time is not None:
            return request.first_token_time + k * request.slo_tpot_s
        if k == 0 and request.slo_ttft_s is not None:
            return request.arrival_time + request.slo_ttft_s
        return None

    def latest_start(self, request: Request) -> float | None:
        """The deadline minus the least time the request's remaining prefill takes."""
        deadline = self.deadline(request)
        if deadline is None:
            return None
        predict = self.context.predict_prefill_s
        if predict is None:
            return deadline
        start = (request.num_computed_tokens if request.status == _RUNNING
                 else self.context.cached_prefix_tokens(request))
        return deadline - predict(request.num_tokens - start, start)

    # ---- the waiting queue ---------------------------------------------------------------
    def add(self, request: Request, now: float) -> None:
        rid = request.request_id
        tenant = request.tenant
        if not self._waiting_of.get(tenant):  # VTC lift: idling banks no credit
            backlogged = [self.counters.get(t, 0.0) for t, n in self._waiting_of.items() if n]
            if backlogged:
                self.counters[tenant] = max(self.counters.get(tenant, 0.0), min(backlogged))
        self._waiting_of[tenant] = self._waiting_of.get(tenant, 0) + 1
        key = self.latest_start(request)
        if key is None:
            self._best_effort.push(rid, request.arrival_time, request)
        else:
            request.policy_state["slo_key"] = key
            self._on_time.push(request, key)  # expired ones move on at the next look

    def requeue(self, request: Request, now: float) -> None:
        self.add(request, now)

    def _expire(self, now: float) -> None:
        """Move on-time requests whose latest start has passed to late (or rejection)."""
        reject = self.config.slo_late_action == "reject"
        while (top := self._on_time.peek_min()) is not None and top[0] < now:
            key, request = top
            self._on_time.remove(request.request_id)
            if reject and request.first_scheduled_time is None:
                self._rejecting[request.request_id] = request
            else:
                self._late.push(request.request_id, (request.arrival_time, key), request)

    def reject_waiting(self, now: float) -> list[Request]:
        self._now = now  # the scheduler calls this first in every step
        self._expire(now)
        return list(self._rejecting.values())

    def peek(self, now: float) -> Request | None:
        self._expire(now)
        first = self._on_time.first()
        if first is not None:
            return first
        for queue in (self._late, self._best_effort):
            top = queue.peek()
            if top is not None:
                return top[1]
        return None

    def pop(self, request: Request) -> None:
        rid = request.request_id
        if (self._on_time.remove(rid) or self._late.remove(rid)
                or self._best_effort.remove(rid) or self._rejecting.pop(rid, None)):
            self._waiting_of[request.tenant] -= 1

    def __len__(self) -> int:
        return (len(self._on_time) + len(self._late) + len(self._best_effort)
                + len(self._rejecting))

    def waiting(self) -> Iterable[Request]:
        def chain() -> Iterator[Request]:
            yield from self._on_time
            yield from self._late
            yield from self._best_effort
            yield from self._rejecting.values()
        return chain()

    # ---- running and preemption ----------------------------------------------------------
    def _due(self, request: Request) -> float:
        deadline = self.deadline(request)
        return math.inf if deadline is None else deadline

    def order_running(self, running: list[Request]) -> list[Request]:
        # Decodes first (one token each: never stalled by a chunk), then chunks by slack.
        def rank(r: Request) -> tuple:
            if r.num_uncomputed_tokens == 1:
                return (0, self._due(r))
            key = self.latest_start(r)
            if key is None:
                return (3, r.admitted_seq)
            return (1 if key >= self._now else 2, key)
        return sorted(running, key=rank)

    def select_victim(self, running: list[Request], requester: Request) -> Request | None:
        return max(running, key=lambda r: (self._due(r), r.admitted_seq), default=None)

    # ---- accounting ----------------------------------------------------------------------
    def _charge(self, tenant: str, amount: float) -> None:
        if amount > 0:
            self.counters[tenant] = (self.counters.get(tenant, 0.0)
                                     + amount / self._weights.get(tenant, 1.0))

    def on_admitted(self, request: Request, now: float) -> None:
        key = request.policy_state.get("slo_key")
        if key is not None and request.num_output_tokens == 0:
            if key < now:
                self.num_admitted_late += 1
            else:
                self.num_admitted_on_time += 1
        if not request.policy_state.get("slo_charged"):
            request.policy_state["slo_charged"] = True
            uncached = request.num_prompt_tokens - max(request.num_cached_tokens, 0)
            self._charge(request.tenant, self.config.fair_input_weight * uncached)

    def on_tokens_generated(self, request: Request, num_tokens: int) -> None:
        self._charge(request.tenant, self.config.fair_output_weight * num_tokens)

    def on_finished(self, request: Request) -> None:
        if request.status == _REJECTED and request.stop_reason == "slo_unattainable":
            self.num_rejected += 1

    def stats(self) -> dict[str, Any]:
        return {"num_admitted_on_time": self.num_admitted_on_time,
                "num_admitted_late": self.num_admitted_late,
                "num_rejected_unattainable": self.num_rejected,
                "tenant_counters": dict(self.counters)}

