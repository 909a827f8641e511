"""The ``onednn`` linear backend: oneDNN (bundled with torch's CPU builds) with the
weight re-blocked once, at load time, in the layout its kernels read.

``torch.nn.functional.linear`` hands each call to the BLAS with the weight in its plain
row-major layout, re-blocking it on every call; packed once, no call pays for that.
Packing happens once per engine; the plain weights are dropped afterwards (the tied
embedding keeps its own).
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.model.dtypes import cpu_has_native_bf16
from conveyor.model.linear.backend import LinearBackend


def onednn_available() -> bool:
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """``x @ weight.T + bias`` through oneDNN with the weight packed once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        # An opaque oneDNN tensor: a plain attribute, not a parameter or buffer.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        self.bias = bias.detach() if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, onednn"


class OneDnnLinearBackend(LinearBackend):
    """oneDNN with the weight re-blocked once."""

    name = "onednn"

    @classmethod
    def supports(cls, device, dtype, weight_dtype=None):
        # bfloat16 only where the CPU multiplies it natively (AVX-512 BF16, AMX: oneDNN
        # picks the instructions); elsewhere it would emulate every product.
        ok = device.type == "cpu" and (dtype == torch.float32 or (
            dtype == torch.bfloat16 and cpu_has_native_bf16()))
        if not (ok and onednn_available()):
            return ("needs a float32 model (or bfloat16 on a CPU with native bf16) on CPU "
                    "and a torch built with oneDNN (mkldnn)")
        return None

    def make_linear(self, weight, bias, gate_up=False):
        return PackedLinear(weight, bias)
