"""The ``native`` and ``native-bf16`` linear backends: conveyor's GEMM
(``kernels/cpu/gemm.c``, AVX2 + FMA) with each weight packed once.

A packed gate/up projection returns silu(gate) * up from the GEMM's epilogue, so the
[T, 2I] intermediate is never written. ``native-bf16`` reads bfloat16 weights with float32
arithmetic: for a bfloat16 checkpoint computed in float32 (CPUs without bf16 arithmetic),
the same bits as ``native`` from half the weight bytes, which is what a decode step is
bound by.
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.kernels import cpu as kernels
from conveyor.kernels.cpu import ops as native
from conveyor.model.linear.backend import LinearBackend


def native_gemm_lib():
    """The kernel library if it has conveyor's GEMM (AVX2 + FMA), else None."""
    lib = kernels.load()
    return lib if lib is not None and native.gemm_available() else None


class NativeLinear(nn.Module):
    """``x @ weight.T + bias`` through ``kernels/cpu/gemm.c`` with the weight packed once
    (``kernels.cpu.ops.PackedGemm``: checked once, and each input on every call).

    ``gate_up``: the weight is a packed [gate; up] projection of 2I rows and the module
    returns ``silu(gate) * up`` ([T, I]); ``applies_silu_mul`` tells the MLP so.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib,
                 gate_up: bool = False, bf16_weight: bool = False) -> None:
        """``bf16_weight``: keep the weight as bfloat16 (half the bytes a call reads); only
        for a weight whose values are bfloat16 ones (a bfloat16 checkpoint computed in
        float32), so the output is bit for bit the float32 kernel's: checked here."""
        super().__init__()
        if gate_up and (bias is not None or weight.shape[0] % 2):
            raise ValueError("a fused gate/up projection needs an even row count, no bias")
        self.lib = lib
        self.out_features, self.in_features = weight.shape
        self.applies_silu_mul = gate_up
        weight = weight.detach()
        if bf16_weight:
            narrow = weight.to(torch.bfloat16).contiguous()
            if weight.dtype is not torch.bfloat16 and not torch.equal(
                    narrow.to(weight.dtype), weight):
                raise ValueError(
                    "a bf16-weight linear takes only weights whose values are bfloat16 "
                    f"ones (a bfloat16 checkpoint); this {weight.dtype} "
                    f"{tuple(weight.shape)} weight would be rounded")
            weight = narrow
        else:
            weight = weight.to(torch.float32).contiguous()
        self.bf16_weight = bf16_weight
        self.gemm = native.PackedGemm(
            weight,
            bias.detach().to(torch.float32).contiguous() if bias is not None else None,
            gate_up)
        self.width = self.gemm.width

    @property
    def packed(self) -> torch.Tensor:
        return self.gemm.packed

    @property
    def bias(self) -> torch.Tensor | None:
        return self.gemm.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype is torch.float32 and x.stride(1) == 1:  # the model's case
            return self.gemm(x)
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        if x.dtype != torch.float32 or x.stride(-1) != 1:
            x = x.to(torch.float32).contiguous()
        return self.gemm(x).view(*lead, self.width)

    def extra_repr(self) -> str:
        kind = ", silu(gate) * up" if self.applies_silu_mul else ""
        kind += ", bf16 weight" if self.bf16_weight else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, native{kind}"


class NativeLinearBackend(LinearBackend):
    """conveyor's GEMM, weights pre-packed, SwiGLU fused into the gate/up projection."""

    name = "native"
    _needs = "needs a float32 model on a CPU with AVX2 and FMA, and the native kernels built"

    @classmethod
    def supports(cls, device, dtype, weight_dtype=None):
        if not (device.type == "cpu" and dtype == torch.float32):
            return f"{cls._needs} (got {str(dtype).removeprefix('torch.')} on {device})"
        if kernels.load() is None:
            return f"{cls._needs} {kernels.why_unavailable()}"
        if native_gemm_lib() is None:
            return f"{cls._needs} (this CPU lacks AVX2 or FMA)"
        return None

    def make_linear(self, weight, bias, gate_up=False):
        return NativeLinear(weight, bias, native_gemm_lib(), gate_up=gate_up)


class NativeBf16WeightLinearBackend(NativeLinearBackend):
    """conveyor's GEMM reading bfloat16 weights, float32 arithmetic."""

    name = "native-bf16"

    @classmethod
    def supports(cls, device, dtype, weight_dtype=None):
        if weight_dtype != torch.bfloat16 or dtype != torch.float32:
            return ("needs a bfloat16 checkpoint computed in float32 (--dtype bfloat16 "
                    "where the CPU lacks bf16 arithmetic, or --compute-dtype float32)")
        return super().supports(device, dtype)

    def make_linear(self, weight, bias, gate_up=False):
        return NativeLinear(weight, bias, native_gemm_lib(), gate_up=gate_up,
                            bf16_weight=True)
