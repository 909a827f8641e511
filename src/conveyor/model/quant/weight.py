"""A quantized projection weight, as every format is read into: integers, one scale (and
optionally one zero point) per output row and group of ``group`` input columns.

``w[n, k] = (q[n, k] - zero[n, k // group]) * scale[n, k // group]`` in float32: the
dequantised weight, which is the reference a quantized model's tokens are checked
against. ``q`` is held unpacked (one int8 per value, int4 ones too) until a module packs
it, so that slicing for tensor parallelism and packing Q/K/V are plain tensor ops.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class QuantWeight:
    q: torch.Tensor  # [N, K] int8: -128..127 for 8 bits, 0..15 (or -8..7) for 4
    scale: torch.Tensor  # [N, K // group] float32
    zero: torch.Tensor | None  # [N, K // group] float32, None: 0
    bits: int
    group: int  # input columns per scale; K for one scale per output row
    # Act-order (GPTQ desc_act): column j of ``q`` is input column perm[j], the columns
    # sorted by group so that groups are contiguous; None: the identity.
    perm: torch.Tensor | None = None
    # W8A8: each input row quantized to int8 on the fly (symmetric, absmax / 127.5, as
    # compressed-tensors' dynamic per-token scheme), integer products summed exactly.
    act_int8: bool = False

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if self.group <= 0 or k % self.group:
            raise ValueError(f"quantized weight: group size {self.group} does not divide "
                             f"its {k} input columns")
        if tuple(self.scale.shape) != (n, k // self.group):
            raise ValueError(f"quantized weight: scales {tuple(self.scale.shape)} for "
                             f"[{n}, {k}] in groups of {self.group}")

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = self.q.to(torch.float32)
        if self.zero is not None:
            q = q - self.zero.repeat_interleave(self.group, dim=1)
        w = q * self.scale.repeat_interleave(self.group, dim=1)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)

    def __getitem__(self, index) -> QuantWeight:
        """Rows (``w[a:b]``), input columns (``w[:, a:b]``, on group boundaries) or the
        whole (``w[:]``), as the loader slices a tensor for tensor parallelism."""
        rows, cols = (index if isinstance(index, tuple) else (index, slice(None)))
        q, scale, zero = self.q[rows], self.scale[rows], (
            self.zero[rows] if self.zero is not None else None)
        if cols != slice(None):
            if self.perm is not None:
                raise ValueError("act-order (g_idx) weights split by input columns (tensor "
                                 "parallelism's row-parallel layers) are not supported")
            start, stop, _ = cols.indices(self.q.shape[1])
            if self.group == self.q.shape[1]:  # one scale per row: it holds for any slice
                return replace(self, q=q[:, start:stop].contiguous(), scale=scale.contiguous(),
                               zero=zero.contiguous() if zero is not None else None,
                               group=stop - start)
            if start % self.group or (stop - start) % self.group:
                raise ValueError(f"tensor parallelism splits input columns {start}:{stop} "
                                 f"across groups of {self.group}: unsupported")
            g = slice(start // self.group, stop // self.group)
            q, scale = q[:, start:stop], scale[:, g]
            zero = zero[:, g] if zero is not None else None
        return replace(self, q=q.contiguous(), scale=scale.contiguous(),
                       zero=zero.contiguous() if zero is not None else None)


def cat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """Weights of the same input columns stacked by output rows (Q/K/V, gate/up)."""
    first = parts[0]
    if any(p.bits != first.bits or p.group != first.group
           or (p.zero is None) != (first.zero is None) for p in parts):
        raise ValueError("packed projections quantized differently (bits, group size or "
                         "zero points) are not supported")
    if any((p.perm is None) != (first.perm is None)
           or (p.perm is not None and not torch.equal(p.perm, first.perm)) for p in parts):
        raise ValueError("packed projections (Q/K/V or gate/up) with different act-order "
                         "permutations are not supported")
    return QuantWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                       torch.cat([p.zero for p in parts]) if first.zero is not None else None,
                       first.bits, first.group, first.perm, first.act_int8)


def quantize_int8(weight: torch.Tensor, absmax: torch.Tensor | None = None) -> QuantWeight:
    """Symmetric int8, one scale per output row (absmax / 127): ``--quantization int8``.
    ``absmax``: each row's, where the rows are split over ranks (the whole row's)."""
    w = weight.detach().to(torch.float32)
    if absmax is None:
        absmax = w.abs().amax(dim=1)
    scale = (absmax.to(torch.float32).view(-1, 1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return QuantWeight(q, scale, None, 8, w.shape[1])


def quantize_int4(weight: torch.Tensor, group: int = 128, symmetric: bool = False
                  ) -> QuantWeight:
    """Int4 in groups of ``group`` columns (asymmetric: 0..15 with a zero point;
    symmetric: -8..7): for timings and tests; checkpoints bring their own."""
    w = weight.detach().to(torch.float32)
    n, k = w.shape
    group = min(group, k)
    g = w.view(n, k // group, group)
    if symmetric:
        scale = (g.abs().amax(dim=2) / 7.0).clamp_min(1e-12)
        q = torch.round(g / scale[..., None]).clamp_(-8, 7)
        zero = None
    else:
        lo, hi = g.amin(dim=2).clamp(max=0), g.amax(dim=2).clamp(min=0)
        scale = ((hi - lo) / 15.0).clamp_min(1e-12)
        zero = torch.round(-lo / scale).clamp_(0, 15)
        q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp_(0, 15)
    return QuantWeight(q.view(n, k).to(torch.int8), scale, zero, 4, group)
