"""Fair queuing across tenants by weighted served tokens (Virtual Token Counter style)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from conveyor.config import PolicyConfig
from conveyor.core.policies.base import SchedulingPolicy, register_policy
from conveyor.core.policies.queues import FifoQueue, LazyHeap
from conveyor.request import Request


@register_policy
class FairPolicy(SchedulingPolicy):
    """Each tenant has a counter of the service it received; the backlogged tenant (one
    with a waiting request) with the smallest counter goes next, its oldest request
    first (after Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024).

    Counting (``phi`` is the tenant's weight from ``tenant_weights``, default 1):

        admission (first time only)   c += input_weight * (prompt - cached tokens) / phi
        every generated token         c += output_weight / phi

    The prompt is charged when the request is admitted, not as its chunks run, so
    several admissions in one step already see each other; a recomputation after
    preemption is not charged again.

    Lift: a tenant that becomes backlogged starts at ``max(own counter, L - credit)``,
    where ``L``, the lift level, is the highest floor seen so far (the floor being the
    smallest counter among the backlogged tenants or, when none is, the current counter
    of the last tenant that stopped being backlogged) and ``credit`` is
    ``fair_rejoin_credit``. With credit 0 this is VTC's lift: an idle tenant banks no
    credit. A positive credit lets a tenant that was idle (a light one, whose previous
    request was charged whole at admission) go before a backlogged heavy tenant instead
    of waiting for it to catch up; ``L`` never decreases, so the credit cannot compound.

    Bound (tested in tests/test_policies_properties.py). Let ``U_x = (input_weight * P
    + output_weight * S * O) / phi_x`` with P the longest prompt, O the largest
    max_tokens and S = max_num_seqs, and B the credit. Without queue-wait overrides,
    every backlogged tenant x satisfies at all times

        m <= c_x <= m + U_x + B        (m: the smallest backlogged counter)

    Proof sketch: x is admitted only while c_x = m (it is the minimum). After its last
    admission c_x grows by at most that admission's prompt charge and the outputs of
    x's requests running at that moment (at most S of them, O tokens each; a preempted
    one cannot come back while c_x > m). m only decreases when a tenant joins, to no
    less than ``L - B``, and ``L`` is at least every earlier m, so m never falls more
    than B below an earlier value. Hence for two tenants f, g that are both backlogged
    throughout an interval, the service they receive in it (the growth of their
    counters) differs by at most ``U_f + U_g + 2B``; FCFS has no such bound.

    Preemption: when a running request needs a block, the victim is the running
    request of the most served tenant (latest admitted within it). Admission
    preemption (``fair_preempt_gap`` not None): when the waiting request the policy
    offers does not fit, the same victim is preempted for it if its tenant has been
    served more than ``fair_preempt_gap`` beyond the candidate's and, after the swap,
    still holds at least as many running requests (divided by weight) as the
    candidate's tenant. Each such swap shrinks the sum over tenants of (running
    count)^2 / weight, so two tenants cannot preempt each other in turn; the
    scheduler's ``max_preemptions_per_request`` applies as for every policy. Running
    requests get the token budget least served tenant first, so a light tenant's
    prefill chunks go before the heavy tenant's. O(1) per queue operation, O(log T)
    amortised per counter update, T the number of backlogged tenants; O(R) per
    admission preemption and O(R log R) per step for the running order (R running).
    """

    name = "fair"

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self._weights = dict(self.config.tenant_weights)
        self._queues: dict[str, FifoQueue] = {}  # backlogged tenants only
        self.counters: dict[str, float] = {}
        self._backlogged: LazyHeap[str] = LazyHeap()  # tenants by counter
        self._last_left: str | None = None  # its counter is m while nobody is backlogged
        self._num_waiting = 0
        self._lift = 0.0  # highest floor a joining tenant was lifted to

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    # ---- the waiting queue ---------------------------------------------------------------
    def add(self, request: Request, now: float) -> None:
        self._enqueue(request, front=False)

    def requeue(self, request: Request, now: float) -> None:
        self._enqueue(request, front=True)

    def _enqueue(self, request: Request, front: bool) -> None:
        tenant = request.tenant
        queue = self._queues.get(tenant)
        if queue is None:  # the tenant becomes backlogged: lift its counter
            top = self._backlogged.peek()
            if top is not None:
                floor = top[0]
            else:
                floor = self.counters.get(self._last_left, 0.0) if self._last_left else 0.0
            # The lift level never decreases, so credit below it cannot compound.
            self._lift = max(self._lift, floor)
            counter = max(self.counters.get(tenant, 0.0),
                          self._lift - self.config.fair_rejoin_credit)
            self.counters[tenant] = counter
            queue = self._queues[tenant] = FifoQueue()
            self._backlogged.push(tenant, counter, tenant)
        if front:
            queue.push_front(request)
        else:
            queue.append(request)
        self._num_waiting += 1

    def peek(self, now: float) -> Request | None:
        top = self._backlogged.peek()
        return self._queues[top[1]].first() if top is not None else None

    def pop(self, request: Request) -> None:
        tenant = request.tenant
        queue = self._queues.get(tenant)
        if queue is None or not queue.remove(request):
            return
        self._num_waiting -= 1
        if not queue:
            del self._queues[tenant]
            self._backlogged.remove(tenant)
            if not self._queues:
                self._last_left = tenant

    def __len__(self) -> int:
        return self._num_waiting

    def waiting(self) -> Iterable[Request]:
        def chain() -> Iterator[Request]:
            for queue in self._queues.values():
                yield from queue
        return chain()

    # ---- accounting ----------------------------------------------------------------------
    def _charge(self, tenant: str, amount: float) -> None:
        if amount <= 0:
            return
        counter = self.counters.get(tenant, 0.0) + amount / self.weight(tenant)
        self.counters[tenant] = counter
        if tenant in self._backlogged:
            self._backlogged.push(tenant, counter, tenant)

    def on_admitted(self, request: Request, now: float) -> None:
        if request.policy_state.get("fair_charged"):
            return  # re-admission after preemption: the prompt was charged once
        request.policy_state["fair_charged"] = True
        uncached = request.num_prompt_tokens - max(request.num_cached_tokens, 0)
        self._charge(request.tenant, self.config.fair_input_weight * uncached)

    def on_tokens_generated(self, request: Request, num_tokens: int) -> None:
        self._charge(request.tenant, self.config.fair_output_weight * num_tokens)

    # ---- the running batch ---------------------------------------------------------------
    def order_running(self, running: list[Request]) -> list[Request]:
        # The least served tenant's chunks first: a light tenant's prefill is not put
        # behind the heavy tenant's chunks when the token budget runs short.
        counter = self.counters.get
        return sorted(running, key=lambda r: (counter(r.tenant, 0.0), r.admitted_seq))

    # ---- preemption ----------------------------------------------------------------------
    def select_victim(self, running: list[Request], requester: Request) -> Request | None:
        return max(running, key=lambda r: (self.counters.get(r.tenant, 0.0), r.admitted_seq),
                   default=None)

    def victim_for_waiting(self, running: list[Request], candidate: Request) -> Request | None:
        # Admission preemption: the youngest request of the most served tenant makes room
        # for a tenant served more than ``fair_preempt_gap`` less, if the victim's tenant
        # still holds at least as many running slots (weighted) as the candidate's after
        # the swap. That second test makes every such preemption shrink the slot
        # imbalance, so two tenants can never preempt each other back and forth.
        gap = self.config.fair_preempt_gap
        if gap is None:
            return None
        victim = self.select_victim(running, candidate)
        if victim is None:
            return None
        counter = self.counters.get
        if counter(victim.tenant, 0.0) - counter(candidate.tenant, 0.0) <= gap:
            return None
        slots = {victim.tenant: 0, candidate.tenant: 0}
        for r in running:
            if r.tenant in slots:
                slots[r.tenant] += 1
        if ((slots[victim.tenant] - 1) / self.weight(victim.tenant)
                < (slots[candidate.tenant] + 1) / self.weight(candidate.tenant)):
            return None
        return victim

    def stats(self) -> dict[str, Any]:
        return {"tenant_counters": dict(self.counters)}
