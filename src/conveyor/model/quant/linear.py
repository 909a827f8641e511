"""The modules that compute ``x @ dequant(W).T + bias`` from a ``QuantWeight``.

- ``NativeQuantLinear``: conveyor's kernel (``kernels/cpu/quant_gemm.c``), int8 or int4
  (nibbles) packed in panels of 16 output rows at load, widened in registers or a small
  buffer, float32 sums; x in any float dtype, computed in float32.
- ``NativeA16Linear``: int4 through ``qgemm_a16``: x rounded to int16 per row, integer
  sums (within a stated bound of the float result, ``quant_gemm.c``), the weight packed in
  column pairs.
- ``Int8MMLinear``: torch's ``_weight_int8pack_mm`` (int8, one scale per row); fast on
  this project's AVX2 CPU for bfloat16 x only.
- ``DequantLinear``: the weight dequantised on every call, then ``F.linear``: portable (any
  device, dtype, format), the fallback, and at prefill sizes the dequantisation is a
  small share of the call.
- ``RowRangeLinear``: two of them over one weight, by the call's row count
  (``autotune/row_ranges.py`` measures where).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels.cpu import quant as qkernel
from conveyor.model.quant.weight import QuantWeight


def _bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    return bias.detach().to(torch.float32).contiguous() if bias is not None else None


def to_panels(t: torch.Tensor, pad: float = 0) -> torch.Tensor:
    """[N, C] as ``quant_gemm.c``'s panels of 16 rows: [ceil(N / 16), C, 16], row 16p + j
    at [p, :, j], rows past N filled with ``pad``."""
    n, c = t.shape
    panels = -(-n // 16)
    out = torch.full((panels * 16, c), pad, dtype=t.dtype)
    out[:n] = t
    return out.view(panels, 16, c).transpose(1, 2).contiguous()


class _QuantLinear(nn.Module):
    applies_silu_mul = False
    kind = ""

    def __init__(self, weight: QuantWeight) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bits, self.group = weight.bits, weight.group

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"int{self.bits} group {self.group}, {self.kind}")


def glu_pairs(n: int) -> torch.Tensor | None:
    """The row order that puts a [gate; up] projection of n = 2I rows in panel pairs (gate
    rows 16i..16i+15, then the up rows beside them), or None where I is not a multiple
    of 16."""
    inter = n // 2
    if n % 2 or inter % 16:
        return None
    gate = torch.arange(inter).view(-1, 16)
    return torch.stack([gate, gate + inter], dim=1).reshape(-1)


class NativeQuantLinear(_QuantLinear):
    """``gate_up``: a [gate; up] projection, computed as silu(gate) * up ([T, I]: the
    module ``applies_silu_mul``) where I is a multiple of 16 and there is no bias."""

    kind = "native"

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None, lib=None,
                 gate_up: bool = False) -> None:
        super().__init__(weight)
        self.lib = lib or qkernel.load()
        order = glu_pairs(self.out_features) if gate_up and bias is None else None
        self.applies_silu_mul = order is not None
        if order is not None:
            weight = QuantWeight(weight.q[order], weight.scale[order],
                                 weight.zero[order] if weight.zero is not None else None,
                                 weight.bits, weight.group, weight.perm, weight.act_int8)
        q, zero = weight.q, weight.zero
        if weight.bits == 4:
            if int(q.min()) < 0:  # signed -8..7: stored as 0..15 with the zero moved by 8
                q = q + 8
                zero = (zero if zero is not None else torch.zeros_like(weight.scale)) + 8
            u = to_panels(q.to(torch.uint8))
            self.qweight = (u[:, :, :8] | (u[:, :, 8:] << 4)).contiguous()
        else:
            self.qweight = to_panels(q)
        self.scales = to_panels(weight.scale.to(torch.float32), 1.0)
        self.zeros = to_panels(zero.to(torch.float32)) if zero is not None else None
        self.bias = _bias(bias)
        self.perm = weight.perm  # act-order: x's columns in the weight's order
        self.gemm = qkernel.PackedQGemm(self.qweight, self.bits, self.scales, self.zeros,
                                        self.group, self.bias, self.out_features,
                                        self.in_features, self.lib, self.applies_silu_mul)
        self.width = self.gemm.width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is None and x.dim() == 2 and x.dtype is torch.float32 \
                and x.stride(1) == 1:  # the model's case: no reshape, no copy
            return self.gemm(x)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        if x2.dtype != torch.float32 or x2.stride(-1) != 1:
            x2 = x2.to(torch.float32).contiguous()
        y = self.gemm(x2)
        return y.to(x.dtype).view(*lead, self.width)


def pack_pairs(q: torch.Tensor) -> torch.Tensor:
    """int4 values 0..15 [N, K] (K even) in ``qgemm_a16``'s layout: uint8 [P, K / 2, 16],
    byte 2i + t of panel p, pair kp holding output 16p + i (low nibble) and 16p + i + 8
    (high) at column 2kp + t."""
    u = to_panels(q.to(torch.uint8))
    p, k, _ = u.shape
    b = u[:, :, :8] | (u[:, :, 8:] << 4)
    return b.view(p, k // 2, 2, 8).transpose(2, 3).reshape(p, k // 2, 16).contiguous()


def pack_pairs_i8(q: torch.Tensor) -> torch.Tensor:
    """int8 values [N, K] (K even) in ``qgemm_a16_i8``'s layout: int8 [P, K / 2, 32],
    byte 2i + t of panel p, pair kp holding output 16p + i at column 2kp + t."""
    u = to_panels(q.to(torch.int8))  # [P, K, 16]
    p, k, _ = u.shape
    return u.view(p, k // 2, 2, 16).transpose(2, 3).reshape(p, k // 2, 32).contiguous()


def _unsigned_int4(weight: QuantWeight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(q as 0..15, zero points): signed -8..7 stored with the zero moved by 8."""
    q, zero = weight.q, weight.zero
    if int(q.min()) < 0:
        q = q + 8
        zero = (zero if zero is not None else torch.zeros_like(weight.scale)) + 8
    return q, zero


class NativeA16Linear(_QuantLinear):
    """An int4 weight through ``qgemm_a16`` or an int8 one through ``qgemm_a16_i8`` (x
    rounded to int16 per row, exact int32 sums): K and the group even, the group at most
    ``quant.A16_MAX_GROUP`` (int4) or ``quant.A16_I8_MAX_GROUP`` (int8)."""

    kind = "native, int16 x"

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None, lib=None) -> None:
        super().__init__(weight)
        if not qkernel.a16_takes(self.in_features, weight.group, weight.bits):
            raise ValueError(f"qgemm_a16 takes int4 or int8 weights of even K and group (at "
                             f"most {qkernel.A16_MAX_GROUP} int4, "
                             f"{qkernel.A16_I8_MAX_GROUP} int8), got int{weight.bits} K = "
                             f"{self.in_features}, group {weight.group}")
        if weight.bits == 4:
            q, zero = _unsigned_int4(weight)
            self.qweight = pack_pairs(q)
        else:
            q, zero = weight.q, weight.zero
            self.qweight = pack_pairs_i8(q)
        self.scales = to_panels(weight.scale.to(torch.float32), 1.0)
        self.zeros = to_panels(zero.to(torch.float32)) if zero is not None else None
        self.bias = _bias(bias)
        self.perm = weight.perm
        self.gemm = qkernel.PackedA16Gemm(self.qweight, self.scales, self.zeros, self.group,
                                          self.bias, self.out_features, self.in_features,
                                          lib or qkernel.load(), weight.bits)
        self.width = self.out_features

    forward = NativeQuantLinear.forward


class Int8MMLinear(_QuantLinear):
    kind = "torch int8mm"

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__(weight)
        if weight.bits != 8 or weight.zero is not None or weight.group != weight.shape[1]:
            raise ValueError("torch's int8 matmul takes symmetric int8 with one scale per "
                             "output row")
        self.qweight = weight.q.contiguous()
        self.scales = weight.scale[:, 0].to(dtype).contiguous()
        self.bias = bias.detach().to(dtype) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features).contiguous(),
                                               self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)


class DequantLinear(_QuantLinear):
    kind = "dequantise per call"

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None) -> None:
        super().__init__(weight)
        self.weight = weight
        self.bias = bias.detach() if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.dequantize(torch.float32).to(x.dtype)
        return F.linear(x, w, self.bias.to(x.dtype) if self.bias is not None else None)


class W8A8Linear(_QuantLinear):
    """W8A8: each row of x quantized to int8 (absmax / 127.5, round half to even, clamp
    to -128..127: compressed-tensors' dynamic per-token scheme), then an int8 x int8 ->
    int32 matmul (``torch._int_mm``: exact sums), scaled by both scales."""

    kind = "w8a8 int_mm"

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None) -> None:
        super().__init__(weight)
        if weight.bits != 8 or weight.zero is not None or weight.group != weight.shape[1]:
            raise ValueError("W8A8 takes symmetric int8 weights with one scale per row")
        self.qweight_t = weight.q.T.contiguous()  # [K, N]
        self.scales = weight.scale[:, 0].to(torch.float32).contiguous()
        self.bias = _bias(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.float32)
        scale = x2.abs().amax(dim=1, keepdim=True) / 127.5
        scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
        xq = torch.round(x2 / scale).clamp_(-128, 127).to(torch.int8)
        if xq.shape[0] <= 16:  # (torch._int_mm wants more than 16 rows on some builds)
            acc = (xq.to(torch.int32) @ self.qweight_t.to(torch.int32))
        else:
            acc = torch._int_mm(xq, self.qweight_t)
        y = acc.to(torch.float32) * scale * self.scales
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).view(*lead, self.out_features)


class RowRangeLinear(nn.Module):
    """Calls of up to ``max_rows`` rows to ``few``, the others to ``many``: two backends'
    modules over the same weight. Where one side applies ``silu(gate) * up`` itself and
    the other does not, this module applies it after the other, so that every call
    returns the same kind of result (the MLP asks ``applies_silu_mul`` once)."""

    def __init__(self, few: nn.Module, many: nn.Module, max_rows: int) -> None:
        super().__init__()
        self.few, self.many, self.max_rows = few, many, max_rows
        self.out_features, self.in_features = many.out_features, many.in_features
        fused = (getattr(few, "applies_silu_mul", False),
                 getattr(many, "applies_silu_mul", False))
        self.applies_silu_mul = any(fused)
        self._then_silu = (self.applies_silu_mul and not fused[0],
                           self.applies_silu_mul and not fused[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        few = x.numel() <= self.max_rows * self.in_features  # (rows, whatever x's rank)
        y = self.few(x) if few else self.many(x)
        if self._then_silu[0 if few else 1]:
            half = y.shape[-1] // 2
            y = F.silu(y[..., :half]) * y[..., half:]
        return y

    def extra_repr(self) -> str:
        return f"up to {self.max_rows} rows to the first"
