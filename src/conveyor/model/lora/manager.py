"""The runner's adapters: loaded ones kept (up to ``max_cpu_loras``, least recently used
dropped first, never one a live request uses) and each step's row groups.

An adapter is read from disk when the runner first meets it (``add``: at start for
``--lora-modules``, else in the step that first schedules one of its requests: the one
disk read on a step's path); a step otherwise only lays out row ranges. ``max_loras``
adapters at most in one step: the scheduler's constraint, checked here.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from conveyor.config.lora import LoRAConfig, LoRARequest
from conveyor.distributed.parallel import SINGLE, TPShard
from conveyor.model.lora.adapter import LoRAAdapter, load_adapter
from conveyor.model.lora.layers import BatchedRows, LoRAContext, LoRAGroup, wrap_lora


class LoRAManager:
    def __init__(self, config: LoRAConfig, model, dtype: torch.dtype,
                 tp: TPShard = SINGLE) -> None:
        """Wraps ``model``'s projections (call before its linears are packed)."""
        self.config = config
        self.model = model
        self.dtype = dtype
        self.tp = tp
        self.context = LoRAContext()
        self.layers = wrap_lora(model, self.context)
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU order
        self.users: dict[int, set[str]] = {}  # adapter id -> live request ids

    def add(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter, loaded now unless it is already (same id and path)."""
        held = self.adapters.get(request.lora_int_id)
        if held is not None and held.request.lora_path == request.lora_path:
            self.adapters.move_to_end(request.lora_int_id)
            return held
        adapter = load_adapter(request, self.model, self.config.max_lora_rank, self.dtype,
                               self.tp)
        for layer in self.layers:
            layer.prepare(adapter, self.config.max_lora_rank)
        self.adapters[request.lora_int_id] = adapter
        self._evict()
        return adapter

    def _evict(self) -> None:
        for lora_id in list(self.adapters):
            if len(self.adapters) <= self.config.cache_size:
                return
            if not self.users.get(lora_id):
                del self.adapters[lora_id]

    def request_added(self, req_id: str, request: LoRARequest | None) -> None:
        if request is not None:
            self.add(request)
            self.users.setdefault(request.lora_int_id, set()).add(req_id)

    def request_dropped(self, req_id: str, lora_id: int) -> None:
        users = self.users.get(lora_id)
        if users is not None:
            users.discard(req_id)
            if not users:
                del self.users[lora_id]
                self._evict()

    def set_step(self, row_loras: list[tuple[int, int, int]]) -> None:
        """This step's groups from (first row, row count, adapter id) per request, in row
        order; adapter id 0 (the base model) forms no group."""
        rows: dict[int, list[tuple[int, int]]] = {}
        for start, n, lora_id in row_loras:
            if lora_id:
                rows.setdefault(lora_id, []).append((start, n))
        if len(rows) > self.config.max_loras:
            raise RuntimeError(f"{len(rows)} adapters in one step, above max_loras "
                               f"{self.config.max_loras} (the scheduler's constraint)")
        groups = []
        for lora_id, spans in rows.items():
            adapter = self.adapters[lora_id]
            self.adapters.move_to_end(lora_id)
            merged: list[list[int]] = []  # adjacent spans as one range
            for start, n in spans:
                if merged and merged[-1][1] == start:
                    merged[-1][1] = start + n
                else:
                    merged.append([start, start + n])
            groups.append(LoRAGroup(adapter, [slice(a, b) for a, b in merged]))
        self.context.batched = batched_rows(groups)
        self.context.groups = groups

    def clear_step(self) -> None:
        self.context.groups = []
        self.context.batched = None


# Adapters in a step from which the batched products replace the per-adapter loop, and
# the most padding they may add (padded rows over real rows).
BATCH_FROM = 4
MAX_PADDING = 2.0


def batched_rows(groups: list[LoRAGroup]) -> BatchedRows | None:
    """The step's rows padded per adapter, or None where the per-adapter loop is better
    (few adapters, or rows so uneven that padding would more than double the work)."""
    if len(groups) < BATCH_FROM:
        return None
    rows = [torch.cat([torch.arange(s.start, s.stop) for s in g.rows]) for g in groups]
    longest = max(len(r) for r in rows)
    total = sum(len(r) for r in rows)
    if longest * len(rows) > MAX_PADDING * total:
        return None
    pad = torch.stack([torch.cat([r, r[:1].expand(longest - len(r))]) for r in rows])
    valid = torch.cat([torch.arange(len(r)) + i * longest for i, r in enumerate(rows)])
    return BatchedRows(pad, valid, torch.cat(rows), tuple(g.adapter.id for g in groups))
