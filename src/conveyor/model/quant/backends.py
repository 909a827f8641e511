"""Quantized linear backends by name (a registry like the float linears'), each for the
weights it can run: ``native-int`` (conveyor's kernel: int8 and int4, any group size,
zero points; needs the kernels built with AVX2 + FMA), ``native-int4-a16`` and
``native-int8-a16`` (int4 / int8 with x rounded to int16 per row, integer sums: within a
stated bound), ``torch-int8mm`` (torch's
int8 weight-only matmul: symmetric int8 per row, bfloat16 or float16 compute on CPU) and
``dequant`` (anywhere). ``auto`` measures the candidates per weight shape on the machine
(``autotune/linears.py``, cached), as the float linears are.

``make_linear`` takes a ``QuantWeight`` or, for the measurement, a float weight that the
backend quantizes in its ``Scheme``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from conveyor.kernels.cpu import quant as qkernel
from conveyor.model.backend_registry import Registry
from conveyor.model.linear.backend import LinearBackend
from conveyor.model.quant.linear import (
    DequantLinear,
    Int8MMLinear,
    NativeA16Linear,
    NativeQuantLinear,
    W8A8Linear,
)
from conveyor.model.quant.weight import QuantWeight, quantize_int4, quantize_int8


@dataclass(frozen=True)
class Scheme:
    """What a model's quantized weights are: bits, group size (0: one per output row),
    zero points."""

    bits: int
    group: int = 0
    zero: bool = False
    act_int8: bool = False  # W8A8: int8 activations per token too

    @property
    def tag(self) -> str:
        return f"w{self.bits}g{self.group}{'z' if self.zero else ''}" + (
            "a8" if self.act_int8 else "")

    @staticmethod
    def of(w: QuantWeight) -> Scheme:
        return Scheme(w.bits, 0 if w.group == w.shape[1] else w.group, w.zero is not None,
                      w.act_int8)

    def quantize(self, weight: torch.Tensor) -> QuantWeight:
        if self.bits == 8 and not self.group and not self.zero:
            from dataclasses import replace

            return replace(quantize_int8(weight), act_int8=self.act_int8)
        if self.bits == 4:
            return quantize_int4(weight, self.group or weight.shape[1],
                                 symmetric=not self.zero)
        raise ValueError(f"no quantizer for {self.tag}")


class QuantLinearBackend(LinearBackend):
    """A kernel for quantized weights of a ``Scheme``."""

    scheme: ClassVar[Scheme | None] = None

    def __init__(self, device: torch.device, dtype: torch.dtype,
                 scheme: Scheme | None = None) -> None:
        super().__init__(device, dtype)
        self.scheme_ = scheme

    @classmethod
    def supports(cls, scheme: Scheme, device: torch.device,  # type: ignore[override]
                 dtype: torch.dtype) -> str | None:
        """None if this backend computes weights of ``scheme`` here, else why not."""
        return None

    def weight(self, weight) -> QuantWeight:
        if isinstance(weight, QuantWeight):
            return weight
        assert self.scheme_ is not None, "a float weight needs the backend's scheme"
        return self.scheme_.quantize(weight)


class NativeQuantBackend(QuantLinearBackend):
    name = "native-int"

    @classmethod
    def supports(cls, scheme, device, dtype):
        if scheme.act_int8:
            return "weight-only (int8 activations: torch-w8a8)"
        if device.type != "cpu" or qkernel.load() is None:
            return "needs the native kernels built, on CPU"
        if not qkernel.simd():
            return "needs a CPU with AVX2 and FMA (else its scalar body is slower than " \
                   "dequantising)"
        return None

    def make_linear(self, weight, bias, gate_up=False) -> nn.Module:
        return NativeQuantLinear(self.weight(weight), bias, gate_up=gate_up)


class NativeA16Backend(QuantLinearBackend):
    """int4 weights (``native-int4-a16``: ``qgemm_a16``) or int8 ones, per row or grouped,
    zero points too (``native-int8-a16``: ``qgemm_a16_i8``), with x rounded to int16 per
    row; a shape it cannot take (odd K or group) gets ``native-int``'s module."""

    name = "native-int4-a16"
    bits: ClassVar[int] = 4

    @classmethod
    def supports(cls, scheme, device, dtype):
        if scheme.bits != cls.bits or scheme.act_int8:
            return "int4 weights only" if cls.bits == 4 else "weight-only int8 only"
        cap = qkernel.A16_MAX_GROUP if cls.bits == 4 else qkernel.A16_I8_MAX_GROUP
        if scheme.group % 2 or scheme.group > cap:
            return f"needs an even group size of at most {cap}"
        return NativeQuantBackend.supports(scheme, device, dtype)

    def make_linear(self, weight, bias, gate_up=False) -> nn.Module:
        qw = self.weight(weight)
        if qw.bits != self.bits or not qkernel.a16_takes(qw.shape[1], qw.group, qw.bits):
            return NativeQuantLinear(qw, bias, gate_up=gate_up)
        return NativeA16Linear(qw, bias)


class NativeInt8A16Backend(NativeA16Backend):
    name = "native-int8-a16"
    bits = 8


class TorchInt8MMBackend(QuantLinearBackend):
    name = "torch-int8mm"

    @classmethod
    def supports(cls, scheme, device, dtype):
        if scheme != Scheme(8):
            return "takes symmetric int8 with one scale per output row only"
        if not hasattr(torch.ops.aten, "_weight_int8pack_mm"):
            return "this torch lacks _weight_int8pack_mm"
        if dtype not in (torch.bfloat16, torch.float16):
            return "slow for float32 activations on CPU (measured): bf16/fp16 only"
        return None

    def make_linear(self, weight, bias, gate_up=False) -> nn.Module:
        return Int8MMLinear(self.weight(weight), bias, self.dtype)


class DequantBackend(QuantLinearBackend):
    name = "dequant"

    @classmethod
    def supports(cls, scheme, device, dtype):
        return "weight-only (int8 activations: torch-w8a8)" if scheme.act_int8 else None

    def make_linear(self, weight, bias, gate_up=False) -> nn.Module:
        return DequantLinear(self.weight(weight), bias)


class W8A8Backend(QuantLinearBackend):
    name = "torch-w8a8"

    @classmethod
    def supports(cls, scheme, device, dtype):
        if scheme != Scheme(8, act_int8=True):
            return "takes W8A8: symmetric int8 weights per row, int8 activations per token"
        return None

    def make_linear(self, weight, bias, gate_up=False) -> nn.Module:
        return W8A8Linear(self.weight(weight), bias)


quant_linear_backends: Registry[type[QuantLinearBackend]] = Registry("quantized linear")
quant_linear_backends.add("native-int", 20, "conveyor.model.quant.backends:NativeQuantBackend")
quant_linear_backends.add("native-int4-a16", 15,
                          "conveyor.model.quant.backends:NativeA16Backend")
quant_linear_backends.add("native-int8-a16", 15,
                          "conveyor.model.quant.backends:NativeInt8A16Backend")
quant_linear_backends.add("torch-int8mm", 10,
                          "conveyor.model.quant.backends:TorchInt8MMBackend")
quant_linear_backends.add("dequant", 0, "conveyor.model.quant.backends:DequantBackend")
quant_linear_backends.add("torch-w8a8", 5, "conveyor.model.quant.backends:W8A8Backend")


def candidates(scheme: Scheme, device: torch.device, dtype: torch.dtype) -> list[str]:
    """The quantized backends that run ``scheme`` here, by priority."""
    return quant_linear_backends.applicable(scheme, device, dtype)
