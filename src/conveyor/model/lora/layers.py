"""The decoder's projections with LoRA: the base projection (whatever its backend) plus,
for each adapter in the step, its delta on that adapter's rows only.

Rows with no adapter never see a LoRA op, so they are exactly the base model's. A
packed projection (qkv_proj, gate_up_proj) holds one slice per target; each target's
delta goes into its slice of the output, before any activation (so gate/up is not fused
with silu where LoRA is on: ``wrap_lora`` wraps before packing, and the packed module is
then a plain projection). The delta is PEFT's ``lora_B(lora_A(x)) * scaling`` added to
the base output, computed per adapter as one product for all the projection's targets
(``FusedLoRA``: their A stacked) and one per target into its slice, the scaling and the
add fused into it (``addmm``): 1 + targets ops per adapter and projection, on contiguous
rows (the runner orders a step's rows by adapter).

With many adapters in a step (``LoRAContext.batched``: more than ``BATCH_FROM`` and little
padding), a projection instead stacks the step's adapters (cached while the step's adapters
stay the same) and runs them all in two batched products over the rows padded per adapter
(S-LoRA/Punica style, with torch ops): a fixed handful of ops whatever the number of
adapters, where the per-adapter loop costs 1 + targets each.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.model.lora.adapter import FusedLoRA, LoRAAdapter


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
        self._stacked: tuple | None = None  # (adapter ids, A^T, [B^T], [scalings])
        self.rank = 0  # --max-lora-rank, set with the first adapter

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def prepare(self, adapter: LoRAAdapter, max_rank: int) -> None:
        """The adapter's fused form for this projection (at load, off the step's path)."""
        adapter.fuse(self.layer, self.slices, max_rank)
        self.rank = max_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.context.batched is not None:
            return self._batched(x, y, self.context.batched)
        for group in self.context.groups:
            f = group.adapter.fused.get(self.key)
            if f is None:
                continue
            r = self.rank
            for rows in group.rows:
                h = F.linear(x[rows], f.a)
                for i in f.present:
                    _, start, width = self.slices[i]
                    y[rows, start:start + width].addmm_(h[:, i * r:(i + 1) * r], f.b_t[i],
                                                        alpha=f.scaling[i])
        return y

    def _batched(self, x: torch.Tensor, y: torch.Tensor, b: BatchedRows) -> torch.Tensor:
        if self._stacked is None or self._stacked[0] != b.key:
            fused = [g.adapter.fused.get(self.key) for g in self.context.groups]
            ref = next((f for f in fused if f is not None), None)
            if ref is None:
                self._stacked = (b.key, None, [], [])
            else:
                zero = FusedLoRA(torch.zeros_like(ref.a),
                                 [torch.zeros_like(t) for t in ref.b_t],
                                 [0.0] * len(ref.b_t), [])
                fused = [f if f is not None else zero for f in fused]
                a_t = torch.stack([f.a for f in fused]).transpose(1, 2)  # [S, in, n * r]
                b_ts = [torch.stack([f.b_t[i] for f in fused]) for i in range(len(ref.b_t))]
                scales = [torch.tensor([f.scaling[i] for f in fused], dtype=ref.a.dtype
                                       ).view(-1, 1, 1) for i in range(len(ref.b_t))]
                self._stacked = (b.key, a_t, b_ts, scales)
        _, a_t, b_ts, scales = self._stacked
        if a_t is None:
            return y
        h = torch.bmm(x[b.pad], a_t)  # [S, L, n * r]
        r = self.rank
        for i, (_, start, width) in enumerate(self.slices):
            delta = torch.bmm(h[:, :, i * r:(i + 1) * r], b_ts[i]) * scales[i]  # [S, L, w]
            y[:, start:start + width].index_add_(0, b.rows, delta.view(-1, width)[b.valid])
        return y

    def extra_repr(self) -> str:
        return f"layer={self.layer}, targets={[s[0] for s in self.slices]}"


def wrap_lora(model: nn.Module, context: LoRAContext) -> list[LoRALinear]:
    """Wrap every decoder projection of ``model`` (a ``DecoderForCausalLM``, its linears
    not yet packed) in a ``LoRALinear`` reading ``context``; returns them."""
    out = []
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        # The delta adds to a float projection's output; experts and quantized modules
        # have no such single projection here yet: refused, never half-applied.
        if not hasattr(mlp, "gate_up_proj"):
            raise ValueError("LoRA adapters on a mixture-of-experts model "
                             f"({type(model).__name__}) are not supported")
        for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if not isinstance(proj, nn.Linear):
                raise ValueError("LoRA adapters over quantized projections (--quantization "
                                 "or a quantized checkpoint) are not supported")
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
