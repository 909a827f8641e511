"""The runner's side of multi-LoRA: the manager (when enabled) and each step's rows."""

from __future__ import annotations

import torch

from conveyor.config.lora import LoRAConfig, LoRARequest
from conveyor.distributed.parallel import TPShard
from conveyor.runner.request_state import RequestState


def make_lora_manager(config: LoRAConfig | None, model, dtype: torch.dtype, tp: TPShard):
    """A ``LoRAManager`` wrapping ``model``'s projections, or None when LoRA is off."""
    if config is None:
        return None
    from conveyor.model.lora.manager import LoRAManager

    manager = LoRAManager(config, model, dtype, tp)
    for lora_id, (name, path) in enumerate(config.modules, start=1):  # the server's ids
        manager.add(LoRARequest(name, lora_id, path))
    return manager


def lora_rows(order: list[str], num_scheduled: dict[str, int],
              requests: dict[str, RequestState]) -> list[tuple[int, int, int]]:
    """(first row, rows, adapter id) of each request in the flat batch, in ``order`` (the
    runner lays each request's tokens out contiguously in that order)."""
    out, cursor = [], 0
    for rid in order:
        n = num_scheduled[rid]
        out.append((cursor, n, requests[rid].lora_id))
        cursor += n
    return out
