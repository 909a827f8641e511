"""Shortest job first by remaining work, with a starvation bound scaled by job size."""

from __future__ import annotations

from typing import Any

from conveyor.config import PolicyConfig
from conveyor.core.policies.base import register_policy
from conveyor.core.policies.keyed import KeyedPolicy
from conveyor.core.policies.predictors import PREDICTORS, OutputLengthPredictor
from conveyor.core.policies.queues import LazyHeap
from conveyor.request import Request


@register_policy
class SJFPolicy(KeyedPolicy):
    """Least remaining work first, where

        work = prompt_weight * tokens still to prefill + expected output tokens to generate

    and the expected output comes from a pluggable predictor (``sjf_predictor``: the
    request's ``expected_output_tokens`` hint, else ``max_tokens``), clamped to
    ``[1, max_tokens]``. A preempted request recomputes everything, so its prefill
    counts again. ``sjf_prompt_weight`` (default 1) prices a prompt token against an
    output token: prefill tokens share a step, each output token costs a step of its
    own, so engine time is closer to a weight well below 1 (step costs fitted on the CPU
    by benchmarks/scheduling/policies.py give 1/7 to 1/20). Both bounds below hold for
    any weight.

    Overtake bound (``sjf_overtake_factor = K``, on by default). The policy keeps a work
    clock ``T``: the work (as above, after the cached prefix) of every request admitted
    so far; no wall clock, so the bound means the same on any hardware. A request of work
    ``w`` joining the queue at ``T0`` is due at ``D = T0 + K * w``; once ``T >= D`` it is
    overdue, and overdue requests go before all others, earliest ``D`` first. Hence:

    * before it is overdue, at most ``K * w`` of work (plus the one admission that
      crosses ``D``) starts ahead of it: its wait is at most about ``K`` times its own
      time alone, whatever arrives;
    * once it is overdue, only requests due earlier go ahead of it, and every one of
      them was already waiting: **no request that joins the queue after it is overdue
      is admitted before it**, so a stream of short arrivals cannot starve it.

    (The scheduler may still pass over a queued request it cannot start this step: a
    long prompt held by the long-prefill cap, or one whose adapter cannot load; that
    delays nothing, as it could not start anyway.)

    Shortest-first is kept until the bound binds, which is why ``K`` is large by default:
    on a queue that stays overloaded for minutes, serving same-length requests together
    is what gives SJF its prefix-cache hits (prompts sharing a prefix have about the same
    length), and a bound that binds early breaks those groups up (docs/scheduling.md).
    Both keys are fixed while a request waits: two heaps, O(log n) per operation.

    Linear aging (``sjf_aging_s = A > 0``, off by default) is the older, wall-clock
    bound: the key becomes ``work / W + arrival / A`` (``W = max_model_len``), so **no
    request is ever overtaken by one that arrived ``A`` seconds or more after it**.

    Running requests get the step's token budget in the same order (least work first),
    so a short request's last prefill chunk is not held behind a long one's.
    """

    name = "sjf"

    def __init__(self, config: PolicyConfig | None = None,
                 predictor: OutputLengthPredictor | None = None) -> None:
        super().__init__(config)
        self.predictor = predictor or PREDICTORS[self.config.sjf_predictor]
        self.work_clock = 0.0  # work of every request admitted so far
        self._due: LazyHeap[Request] = LazyHeap()  # waiting requests by due time
        self._due_at: dict[str, float] = {}  # kept while set aside, dropped at admission
        self.num_overdue = 0  # admissions of overdue requests

    def remaining_work(self, request: Request) -> float:
        expected = min(max(int(self.predictor(request)), 1), request.max_tokens)
        to_generate = max(expected - request.num_output_tokens, 1)
        return self.config.sjf_prompt_weight * request.num_uncomputed_tokens + to_generate

    def key(self, request: Request, now: float) -> tuple[float, float]:
        work = self.remaining_work(request)
        aging = self.config.sjf_aging_s
        if aging <= 0:
            return (work, request.arrival_time)
        max_work = self.context.max_model_len
        if max_work is None:
            raise RuntimeError("sjf aging needs max_model_len: the scheduler binds it; "
                               "call policy.bind(PolicyContext(max_model_len=...)) first")
        return (min(work, max_work) / max_work + request.arrival_time / aging,
                request.arrival_time)

    def due_at(self, request_id: str) -> float | None:
        """Work clock at which a waiting request becomes overdue (None: no bound)."""
        return self._due_at.get(request_id)

    def _enqueue(self, request: Request, now: float) -> None:
        self._queue.push(request.request_id, self.key(request, now), request)
        factor = self.config.sjf_overtake_factor
        if factor <= 0:
            return
        rid = request.request_id
        # A set-aside request comes back with its due time; a new or preempted one
        # starts its count now.
        due = self._due_at.setdefault(
            rid, self.work_clock + factor * self.remaining_work(request))
        self._due.push(rid, due, request)

    def add(self, request: Request, now: float) -> None:
        self._enqueue(request, now)

    def requeue(self, request: Request, now: float) -> None:
        self._enqueue(request, now)

    def peek(self, now: float) -> Request | None:
        top = self._due.peek()
        if top is not None and top[0] <= self.work_clock:
            return top[1]  # overdue: earliest due first
        return super().peek(now)

    def pop(self, request: Request) -> None:
        super().pop(request)
        self._due.remove(request.request_id)

    def on_admitted(self, request: Request, now: float) -> None:
        due = self._due_at.pop(request.request_id, None)
        if due is not None and due <= self.work_clock:
            self.num_overdue += 1
        self.work_clock += self.remaining_work(request)

    def on_finished(self, request: Request) -> None:
        self._due_at.pop(request.request_id, None)

    def order_running(self, running: list[Request]) -> list[Request]:
        return sorted(running, key=self.remaining_work)

    def stats(self) -> dict[str, Any]:
        return {"num_admitted_overdue": self.num_overdue, "work_clock": self.work_clock}
