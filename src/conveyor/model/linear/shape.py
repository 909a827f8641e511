"""A projection's weight shape as the backend choice keys it, and a model's shapes."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class LinearShape:
    out_features: int
    in_features: int
    gate_up: bool = False  # silu(gate) * up follows (fused by backends that can)
    lm_head: bool = False  # runs on the sampled rows only: decode rows in both cases

    @property
    def key(self) -> str:
        tag = "+silu" if self.gate_up else ("+head" if self.lm_head else "")
        return f"{self.out_features}x{self.in_features}{tag}"


def model_shape_counts(model: nn.Module, lm_head: torch.Tensor,
                       skip: frozenset[int] = frozenset()) -> dict[LinearShape, int]:
    """Each weight shape of a model's ``nn.Linear``s and its LM head: how many it has
    (``skip``: ids of linears left out, packed by a backend of their own)."""
    counts: dict[LinearShape, int] = {}
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Linear) and id(child) not in skip:
                shape = LinearShape(*child.weight.shape, gate_up=name == "gate_up_proj")
                counts[shape] = counts.get(shape, 0) + 1
    head = LinearShape(*lm_head.shape, lm_head=True)
    counts[head] = counts.get(head, 0) + 1
    return counts
