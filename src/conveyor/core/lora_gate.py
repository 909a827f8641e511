"""``--max-loras`` as a constraint of the step: the scheduler admits a request only if its
adapter is among the running requests' adapters or one more fits, so every running
request can always run (the runner holds at most ``max_loras`` adapters in a step).

Requests of an adapter that cannot enter are set aside for the step (the scan goes on
past them: base-model requests and those of adapters already in run). No adapter starves:
an adapter that cannot enter is *blocked* from the first step it waits so, and blocked
adapters enter in that order. While some adapter is blocked and the set is full, the
adapter that entered the set first *drains*: its waiting requests are not admitted, so
its running ones finish (each within its max_tokens) and it leaves; the slot then goes
to the longest-blocked adapter, not to whichever request the policy offers first. So an
adapter waits at most for the adapters blocked before it, one drain each.

Torch-free and clock-free, like the scheduler: steps are counted, not timed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from conveyor.request import Request


class LoRAGate:
    def __init__(self, max_loras: int, drain: bool = True) -> None:
        self.max_loras = max_loras
        self.drain = drain  # the drain rule (off: a burst may hold the slots)
        self.in_run: Counter[int] = Counter()  # adapter id -> running requests
        self.entered: dict[int, int] = {}  # adapter id -> sequence number of its entry
        self.blocked: dict[int, int] = {}  # adapter id -> sequence number it was blocked
        self._seq = 0

    def begin_step(self, running: Iterable[Request], waiting: Iterable[Request]) -> None:
        """The running adapters as they are now; blocked adapters with no waiting request
        left (aborted, finished) are forgotten."""
        self.in_run = Counter(r.lora_id for r in running if r.lora_id)
        for lora_id in list(self.entered):
            if lora_id not in self.in_run:
                del self.entered[lora_id]
        for lora_id in self.in_run:
            self.entered.setdefault(lora_id, self._next())
        if self.blocked:
            waiting_ids = {r.lora_id for r in waiting}
            for lora_id in list(self.blocked):
                if lora_id not in waiting_ids:
                    del self.blocked[lora_id]

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    @property
    def draining(self) -> int | None:
        """The adapter that takes no new requests: the earliest entered, while another is
        blocked and the set is full."""
        if not self.drain or not self.blocked or len(self.in_run) < self.max_loras:
            return None
        return min(self.entered, key=self.entered.__getitem__)

    def blocked_order(self) -> list[int]:
        """The blocked adapters, longest blocked first."""
        return sorted(self.blocked, key=self.blocked.__getitem__)

    def first_blocked(self) -> int | None:
        return min(self.blocked, key=self.blocked.__getitem__) if self.blocked else None

    def may_admit(self, request: Request) -> bool:
        """Whether ``request`` may join the running batch now (the base model always may);
        a refused adapter is recorded as blocked."""
        lora_id = request.lora_id
        if not lora_id:
            return True
        if lora_id in self.in_run:
            if lora_id != self.draining:
                return True
        elif len(self.in_run) < self.max_loras and self.first_blocked() in (None, lora_id):
            return True
        self.blocked.setdefault(lora_id, self._next())
        return False

    def admitted(self, request: Request) -> None:
        lora_id = request.lora_id
        if lora_id:
            if lora_id not in self.in_run:
                self.entered[lora_id] = self._next()
            self.in_run[lora_id] += 1
            self.blocked.pop(lora_id, None)

    def left(self, request: Request) -> None:
        """A running request left the batch within the step (preempted)."""
        lora_id = request.lora_id
        if lora_id and self.in_run[lora_id] > 0:
            self.in_run[lora_id] -= 1
            if not self.in_run[lora_id]:
                del self.in_run[lora_id]
                self.entered.pop(lora_id, None)
