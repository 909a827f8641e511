"""What a linear backend provides: the module that computes one projection."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn


class LinearBackend:
    """How a model's projections run; ``registry.py`` names it and gives its priority.
    ``packs``: whether packing replaces each ``nn.Linear`` by ``make_linear``'s module
    (False: the model keeps its own)."""

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 0
    packs: ClassVar[bool] = True

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype,
                 weight_dtype: torch.dtype | None = None) -> str | None:
        """None if the backend can run this configuration, else why not. ``dtype``: the
        arithmetic's; ``weight_dtype``: the checkpoint's, where it differs (a bfloat16
        model computed in float32), else None."""
        return None

    def make_linear(self, weight: torch.Tensor, bias: torch.Tensor | None,
                    gate_up: bool = False) -> nn.Module:
        """The module computing ``x @ weight.T + bias``; with ``gate_up`` it may return
        ``silu(gate) * up`` instead, and then has ``applies_silu_mul = True``."""
        raise NotImplementedError
