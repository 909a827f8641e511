"""The decoder's projections with LoRA: the base projection (whatever its backend) plus,
for each adapter in the step, its delta on that adapter's rows only.

Rows with no adapter never see a LoRA op, so they are exactly the base model's. A
packed projection (qkv_proj, gate_up_proj) holds one slice per target; each target's
delta goes into its slice of the output, before any activation (so gate/up is not fused
with silu where LoRA is on: ``wrap_lora`` wraps before packing, and the packed module is
then a plain projection). The delta is PEFT's ``lora_B(lora_A(x)) * scaling`` added to
the base output, computed per adapter as two products over the projection's targets at
once (``FusedLoRA``: A stacked, B block-diagonal), the scaling and the add fused into
the second (``addmm``): two ops per adapter and projection, on contiguous rows (the
runner orders a step's rows by adapter).

With many adapters in a step (``LoRAContext.batched``: more than ``BATCH_FROM`` and little
padding), a projection instead stacks the step's adapters (cached while the step's adapters
stay the same) and runs them all in two batched products over the rows padded per adapter
(S-LoRA/Punica style, with torch ops): a fixed handful of ops whatever the number of
adapters, where the per-adapter loop costs two each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.model.lora.adapter import LoRAAdapter


@dataclass
class LoRAGroup:
    """One adapter's rows in the step's flat batch: contiguous ranges."""

    adapter: LoRAAdapter
    rows: list[slice]


@dataclass
class BatchedRows:
    """The step's adapter rows padded per adapter: ``pad`` [S, L] row ids (padding repeats
    a real row), ``valid`` the positions of real rows in the flattened [S * L], ``rows``
    their row ids in the same order; ``key``: the adapters' ids, in group order."""

    pad: torch.Tensor
    valid: torch.Tensor
    rows: torch.Tensor
    key: tuple[int, ...]


@dataclass
class LoRAContext:
    """Set by the runner before each forward; every ``LoRALinear`` of the model reads it."""

    groups: list[LoRAGroup] = field(default_factory=list)
    batched: BatchedRows | None = None


class LoRALinear(nn.Module):
    """``base(x)`` plus each group's LoRA delta on its rows. ``slices``: (target, first
    output column, width) of each adapted target within the base's output."""

    applies_silu_mul = False

    def __init__(self, base: nn.Module, layer: int, slices: list[tuple[str, int, int]],
                 context: LoRAContext) -> None:
        super().__init__()
        self.base = base
        self.layer = layer
        self.slices = slices
        self.key = (layer, slices[0][0])
        self.width = sum(w for _, _, w in slices)
        self.context = context
        self._stacked: tuple | None = None  # (adapter ids, A, B^T, column scales)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def prepare(self, adapter: LoRAAdapter, max_rank: int) -> None:
        """The adapter's fused form for this projection (at load, off the step's path)."""
        adapter.fuse(self.layer, self.slices, self.width, max_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.context.batched is not None:
            return self._batched(x, y, self.context.batched)
        for group in self.context.groups:
            f = group.adapter.fused.get(self.key)
            if f is None:
                continue
            for rows in group.rows:
                h = F.linear(x[rows], f.a)
                if f.alpha is not None:
                    y[rows].addmm_(h, f.b_t, alpha=f.alpha)
                else:
                    y[rows] += (h @ f.b_t) * f.col_scale
        return y

    def _batched(self, x: torch.Tensor, y: torch.Tensor, b: BatchedRows) -> torch.Tensor:
        if self._stacked is None or self._stacked[0] != b.key:
            fused = [g.adapter.fused.get(self.key) for g in self.context.groups]
            if any(f is None for f in fused):  # an adapter leaves this projection alone
                ref = next((f for f in fused if f is not None), None)
                if ref is None:
                    return y
                zero = (ref.a.new_zeros(ref.a.shape), ref.b_t.new_zeros(ref.b_t.shape),
                        ref.col_scale.new_zeros(ref.col_scale.shape))
            stacks = [torch.stack([(f.a, f.b_t, f.col_scale)[i] if f is not None else zero[i]
                                   for f in fused]) for i in range(3)]
            self._stacked = (b.key, stacks[0].transpose(1, 2), stacks[1],
                             stacks[2].unsqueeze(1))
        _, a_t, b_t, scale = self._stacked
        h = torch.bmm(x[b.pad], a_t)  # [S, L, R]
        delta = torch.bmm(h, b_t) * scale  # [S, L, out]
        y.index_add_(0, b.rows, delta.view(-1, delta.shape[-1])[b.valid])
        return y

    def extra_repr(self) -> str:
        return f"layer={self.layer}, targets={[s[0] for s in self.slices]}"


def wrap_lora(model: nn.Module, context: LoRAContext) -> list[LoRALinear]:
    """Wrap every decoder projection of ``model`` (a ``DecoderForCausalLM``, its linears
    not yet packed) in a ``LoRALinear`` reading ``context``; returns them."""
    out = []
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate
        attn.qkv_proj = LoRALinear(attn.qkv_proj, i, [
            ("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)], context)
        attn.o_proj = LoRALinear(attn.o_proj, i, [("o_proj", 0, attn.o_proj.out_features)],
                                 context)
        mlp.gate_up_proj = LoRALinear(mlp.gate_up_proj, i, [
            ("gate_proj", 0, inter), ("up_proj", inter, inter)], context)
        mlp.down_proj = LoRALinear(mlp.down_proj, i,
                                   [("down_proj", 0, mlp.down_proj.out_features)], context)
        out += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    return out
