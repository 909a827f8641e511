"""The runner's adapters: loaded ones kept (up to ``max_cpu_loras``, least recently used
dropped first, never one a live request uses or the core has pinned) and each step's row
groups.

Adapters are read on a thread of their own, off the step's path: the core orders a load
(``order``: ``SchedulerOutput.lora_load``, which pins it until ``lora_release``) before it
schedules the adapter's requests, and the step thread installs finished loads and reports
them (``poll``: ``ModelRunnerOutput.lora_loaded`` / ``lora_failed``). ``--lora-modules``
are read at start. A request whose adapter is not held when it is scheduled (an executor
driven without the core's orders) has it read in the step, counted in ``step_loads``.
``max_loras`` adapters at most in one step: the scheduler's constraint, checked here.
"""

from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

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
        self.pinned: set[int] = set()  # ordered by the core, not released since
        self._pending: dict[int, Future] = {}  # loads in flight on the loader thread
        self._loader: ThreadPoolExecutor | None = None
        self._loaded: list[int] = []  # to report
        self._failed: dict[int, str] = {}
        self.step_loads = 0  # adapters read on a step's path (none under the core)

    def _held(self, request: LoRARequest) -> LoRAAdapter | None:
        held = self.adapters.get(request.lora_int_id)
        if held is not None and held.request.lora_path == request.lora_path:
            return held
        return None

    def _read(self, request: LoRARequest) -> LoRAAdapter:
        """Read and fuse an adapter (the loader thread's work: it touches only the new
        adapter's tensors)."""
        adapter = load_adapter(request, self.model, self.config.max_lora_rank, self.dtype,
                               self.tp)
        for layer in self.layers:
            layer.prepare(adapter, self.config.max_lora_rank)
        return adapter

    def _install(self, adapter: LoRAAdapter) -> None:
        self.adapters[adapter.id] = adapter
        self.adapters.move_to_end(adapter.id)
        self._evict()

    def add(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter, loaded now unless it is already (same id and path)."""
        held = self._held(request)
        if held is not None:
            self.adapters.move_to_end(request.lora_int_id)
            return held
        pending = self._pending.pop(request.lora_int_id, None)
        adapter = pending.result() if pending is not None else self._read(request)
        self._install(adapter)
        return adapter

    def order(self, load: list[LoRARequest], release: list[int]) -> None:
        """The core's orders for this step: releases first, then loads (on the loader
        thread unless held; a held one is reported at the next ``poll``)."""
        for lora_id in release:
            self.pinned.discard(lora_id)
        for request in load:
            lora_id = request.lora_int_id
            self.pinned.add(lora_id)
            if self._held(request) is not None:
                self.adapters.move_to_end(lora_id)
                self._loaded.append(lora_id)
            elif lora_id not in self._pending:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(1, thread_name_prefix="conveyor-lora")
                self._pending[lora_id] = self._loader.submit(self._read, request)
        self._evict()

    def poll(self, wait_s: float = 0.0) -> tuple[list[int], dict[int, str]]:
        """Install the loads that finished (waiting up to ``wait_s`` for one if none has)
        and return what to report: (loaded ids, failed id -> why)."""
        if wait_s > 0 and self._pending and not any(f.done() for f in self._pending.values()):
            wait(list(self._pending.values()), timeout=wait_s, return_when=FIRST_COMPLETED)
        for lora_id, future in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[lora_id]
            try:
                adapter = future.result()
            except Exception as e:  # (that adapter's requests fail, nothing else)
                self.pinned.discard(lora_id)
                self._failed[lora_id] = f"{type(e).__name__}: {e}"
                continue
            self._install(adapter)
            self._loaded.append(lora_id)
        loaded, failed = self._loaded, self._failed
        self._loaded, self._failed = [], {}
        return loaded, failed

    def _evict(self) -> None:
        for lora_id in list(self.adapters):
            if len(self.adapters) <= self.config.cache_size:
                return
            if not self.users.get(lora_id) and lora_id not in self.pinned:
                del self.adapters[lora_id]

    def request_added(self, req_id: str, request: LoRARequest | None) -> None:
        if request is not None:
            if self._held(request) is None:
                self.step_loads += 1
            self.add(request)
            self.users.setdefault(request.lora_int_id, set()).add(req_id)

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True, cancel_futures=True)

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
