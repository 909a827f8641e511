"""Adapters loaded ahead of their requests: which adapters the executor holds, decided by
the core and reported back as data (torch-free, clock-free).

The core keeps at most ``capacity`` adapters (``--max-cpu-loras``) *resident*: ordered
loaded (``SchedulerOutput.lora_load``; the executor reads it on a thread, off the step's
path, and keeps it until released) and not released since. Each step it wants, in this
order, the adapters in run, the blocked ones in the order the LoRA gate blocked them, then
the other waiting requests' adapters; a wanted adapter that is not resident is ordered in,
releasing (``lora_release``, applied first) a resident one nobody runs: one no request
wants, else the least wanted. The executor reports each load (``ModelRunnerOutput.
lora_loaded`` / ``lora_failed``); until then the adapter's requests wait in the queue
without blocking the others. A failed load fails that adapter's waiting requests only
(``LORA_LOAD_FAILED``). An executor without adapters (the cost model) answers every order
loaded at once.
"""

from __future__ import annotations

from collections.abc import Iterable

from conveyor.config.lora import LoRARequest
from conveyor.request import Request

# stop_reason prefix of a request whose adapter failed to load (the server's 400).
LORA_LOAD_FAILED = "lora_load_failed"

LOADING, READY = "loading", "ready"


class LoRALoads:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.resident: dict[int, str] = {}  # adapter id -> LOADING | READY, oldest first
        self._load: list[LoRARequest] = []
        self._release: list[int] = []
        self.num_loads = 0  # orders given (stats)

    def is_ready(self, request: Request) -> bool:
        """Whether ``request`` may be scheduled: the base model, or its adapter loaded."""
        return not request.lora_id or self.resident.get(request.lora_id) == READY

    def plan(self, in_run: Iterable[int], blocked: Iterable[int],
             waiting: Iterable[Request]) -> None:
        """Order in the wanted adapters that fit (see the module's rule)."""
        running = set(in_run)
        wanted: dict[int, LoRARequest | None] = dict.fromkeys(running)
        wanted.update(dict.fromkeys(blocked))
        first: dict[int, tuple[float, LoRARequest]] = {}  # earliest waiting request
        for req in waiting:
            if req.lora_id and (req.lora_id not in first
                                or req.arrival_time < first[req.lora_id][0]):
                first[req.lora_id] = (req.arrival_time, req.lora_request)
        for lora_id in sorted(first, key=lambda i: first[i][0]):
            wanted[lora_id] = first[lora_id][1]
        rank = {lora_id: i for i, lora_id in enumerate(wanted)}
        for lora_id, lora_request in wanted.items():
            if lora_id in self.resident or lora_request is None:
                continue  # (an adapter in run with no waiting request is resident)
            if len(self.resident) >= self.capacity:
                spare = [i for i in self.resident if i not in running
                         and rank.get(i, len(rank)) > rank[lora_id]]
                if not spare:
                    break  # the wanted ones before it hold every slot
                victim = max(spare, key=lambda i: rank.get(i, len(rank)))
                del self.resident[victim]
                self._release.append(victim)
            self.resident[lora_id] = LOADING
            self._load.append(lora_request)
            self.num_loads += 1

    def take_orders(self) -> tuple[list[LoRARequest], list[int]]:
        """This step's (loads, releases); the executor applies the releases first."""
        load, release = self._load, self._release
        self._load, self._release = [], []
        return load, release

    def on_report(self, loaded: Iterable[int], failed: dict[int, str]) -> dict[int, str]:
        """Fold in the executor's report; returns the adapters whose load failed (no longer
        resident: a later request orders it again)."""
        for lora_id in loaded:
            if self.resident.get(lora_id) == LOADING:
                self.resident[lora_id] = READY
        failures = {i: e for i, e in failed.items() if self.resident.get(i) == LOADING}
        for lora_id in failures:
            del self.resident[lora_id]
        return failures

    def stats(self) -> dict[str, int]:
        loading = sum(1 for s in self.resident.values() if s == LOADING)
        return {"resident": len(self.resident) - loading, "loading": loading,
                "loads_ordered": self.num_loads}
