"""The cost model's adapter slots (no torch): ``max_loras`` slots, as a GPU engine holds
adapters for its steps; a step whose adapters are not all in a slot pays ``swap_s`` per
adapter copied in (the least recently used slot goes). The core's ``--max-loras`` keeps
a step within the slots; loading into the CPU-side cache is off the step (not priced)."""

from __future__ import annotations

from collections import OrderedDict

from conveyor.core.scheduler_output import SchedulerOutput


class AdapterSlots:
    def __init__(self, num_slots: int, swap_s: float) -> None:
        self.num_slots = max(num_slots, 1)
        self.swap_s = swap_s
        self.slots: OrderedDict[int, None] = OrderedDict()  # adapter ids, LRU first
        self.adapter_of: dict[str, int] = {}  # request id -> adapter id (0: base)
        self.num_swaps = 0

    def step_cost(self, out: SchedulerOutput) -> float:
        """Seconds this step spends swapping adapters in (and track its requests)."""
        for rid in out.finished_req_ids:
            self.adapter_of.pop(rid, None)
        for new in out.new_reqs:
            self.adapter_of[new.req_id] = (new.lora_request.lora_int_id
                                           if new.lora_request is not None else 0)
        swaps = 0
        for lora_id in {self.adapter_of.get(rid, 0) for rid in out.num_scheduled_tokens}:
            if not lora_id:
                continue
            if lora_id not in self.slots:
                swaps += 1
                if len(self.slots) >= self.num_slots:
                    self.slots.popitem(last=False)
            self.slots[lora_id] = None
            self.slots.move_to_end(lora_id)
        self.num_swaps += swaps
        return swaps * self.swap_s
