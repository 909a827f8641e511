"""Packing a model's linears: each ``nn.Linear`` replaced by its backend's module (the
weight re-blocked once), optionally split by row count (``few_rows.py``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from conveyor.model.linear.few_rows import RowSplitLinear, few_row_linear
from conveyor.model.linear.native import NativeLinear
from conveyor.model.linear.registry import linear_backends


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None, backend: str,
                  gate_up: bool = False) -> nn.Module:
    """A pre-packed replacement for ``nn.Linear(weight, bias)`` from linear backend
    ``backend`` (``onednn``, ``native``, ...); ``gate_up`` fuses the SwiGLU activation
    where the backend can (native: check the module's ``applies_silu_mul``)."""
    cls = linear_backends.get(backend)
    if not cls.packs:
        raise ValueError(f"no packed linear for backend {backend!r}")
    return cls(weight.device, weight.dtype).make_linear(weight, bias, gate_up=gate_up)


def pack_linears_by(model: nn.Module, backend_of: Callable[[str, torch.Tensor], str],
                    few_rows: int = 0, lib=None) -> int:
    """Replace each ``nn.Linear`` by the packed one of ``backend_of(name, weight)`` (a
    backend that does not pack, ``torch``, keeps it); returns how many were packed. With
    ``few_rows``, calls of up to that many rows go to conveyor's GEMM on a copy of the
    weight (``few_rows.RowSplitLinear``; ``lib``: the kernels with the GEMM), unless the
    projection is the GEMM's already."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                backend = backend_of(name, child.weight)
                module: nn.Module = child
                if linear_backends.get(backend).packs:
                    module = packed_linear(child.weight, child.bias, backend,
                                           gate_up=_fuses_silu(parent, name))
                    count += 1
                if (few_rows > 0 and not isinstance(module, NativeLinear)
                        and not getattr(module, "applies_silu_mul", False)):
                    module = RowSplitLinear(few_row_linear(child.weight, child.bias,
                                                           child.weight.dtype, lib),
                                            module, few_rows)
                if module is not child:
                    setattr(parent, name, module)
    return count


def pack_linears(model: nn.Module, backend: str = "onednn") -> int:
    """Replace every ``nn.Linear`` in ``model`` by a packed one; returns how many. With
    ``native``, every ``gate_up_proj`` also applies silu(gate) * up."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, packed_linear(child.weight, child.bias, backend,
                                                    gate_up=_fuses_silu(parent, name)))
                count += 1
    return count


def _fuses_silu(parent: nn.Module, name: str) -> bool:
    """A gated MLP's ``gate_up_proj`` takes silu(gate) * up fused in, unless its MLP
    says its activation is another (``fuses_silu``: Gemma's gelu-tanh)."""
    return name == "gate_up_proj" and getattr(parent, "fuses_silu", True)
