"""Linear layers with their weights pre-packed once (CPU, float32): for conveyor's own
GEMM kernel (``kernels/gemm.c``, the default where it builds) or for oneDNN.

``torch.nn.functional.linear`` hands each call to the BLAS with the weight in its plain
row-major layout, re-blocking it on every call. oneDNN (bundled with torch's CPU builds)
can take the weight re-blocked once, at load time, in the layout its kernels read: on
this project's 2-core AVX2 machine a SmolLM2-135M decode step's GEMMs at batch 32 went
from 202 to 115 ms (and a 2,048-token prefill's from 64 to 52 ms per 3072x576
projection). vLLM's CPU backend does the same. Packing happens once per engine; the
plain weights are dropped afterwards (the tied embedding keeps its own).

``NativeLinear`` goes one step further with conveyor's kernel (AVX2 + FMA): 5-10% faster
than oneDNN on the model's prefill projections here, and a packed gate/up projection
returns silu(gate) * up from the GEMM's epilogue, so the [T, 2I] intermediate is never
written (see gemm.c).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from conveyor.model import kernels

logger = logging.getLogger(__name__)

LINEAR_BACKENDS = ("auto", "torch", "onednn", "native")


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


def native_gemm_lib():
    """The kernel library if it has conveyor's GEMM (AVX2 + FMA), else None."""
    lib = kernels.load()
    return lib if lib is not None and lib.gemm_f32_available() else None


class NativeLinear(nn.Module):
    """``x @ weight.T + bias`` through ``kernels/gemm.c`` with the weight packed once.

    ``gate_up``: the weight is a packed [gate; up] projection of 2I rows and the module
    returns ``silu(gate) * up`` ([T, I]); ``applies_silu_mul`` tells the MLP so.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib,
                 gate_up: bool = False) -> None:
        super().__init__()
        if gate_up and (bias is not None or weight.shape[0] % 2):
            raise ValueError("a fused gate/up projection needs an even row count, no bias")
        self.lib = lib
        self.out_features, self.in_features = weight.shape
        self.applies_silu_mul = gate_up
        w = weight.detach().to(torch.float32).contiguous()
        size = lib.gemm_packed_size(self.out_features, self.in_features, int(gate_up))
        # torch's CPU allocator aligns to 64 bytes, as the kernel's aligned loads need.
        self.packed = torch.empty(size, dtype=torch.float32)
        lib.gemm_pack_weight_f32(w.data_ptr(), self.packed.data_ptr(), self.out_features,
                                 self.in_features, int(gate_up))
        self.bias = bias.detach().to(torch.float32).contiguous() if bias is not None else None
        self.width = self.out_features // 2 if gate_up else self.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        if x.dim() != 2:
            x = x.reshape(-1, self.in_features)
        if x.dtype != torch.float32 or x.stride(-1) != 1:
            x = x.to(torch.float32).contiguous()
        rows = x.shape[0]
        out = torch.empty((rows, self.width), dtype=torch.float32)
        if rows:
            rc = self.lib.gemm_f32(x.data_ptr(), x.stride(0), self.packed.data_ptr(),
                                   self.bias.data_ptr() if self.bias is not None else None,
                                   out.data_ptr(), self.width, rows, self.out_features,
                                   self.in_features, int(self.applies_silu_mul))
            if rc != 0:
                raise MemoryError("native GEMM: out of memory for its packing buffers")
        return out.view(*lead, self.width)

    def extra_repr(self) -> str:
        kind = ", silu(gate) * up" if self.applies_silu_mul else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, native{kind}"


def pick_linear_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """Which linears a model gets: ``native`` (conveyor's GEMM), ``onednn`` or ``torch``
    (plain ``F.linear``). ``auto``: native for float32 on an AVX2 CPU, else oneDNN for
    float32 on CPU where torch has it, else torch."""
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {LINEAR_BACKENDS}, got {backend!r}")
    fp32_cpu = device.type == "cpu" and dtype == torch.float32
    if backend == "onednn" and not (fp32_cpu and onednn_available()):
        raise ValueError("linear_backend='onednn' needs a float32 model on CPU and a torch "
                         "built with oneDNN (mkldnn)")
    if backend == "native" and not (fp32_cpu and native_gemm_lib() is not None):
        raise ValueError("linear_backend='native' needs a float32 model on a CPU with AVX2 "
                         "and FMA, and the native kernels built " + kernels.why_unavailable())
    if backend != "auto":
        return backend
    if fp32_cpu and native_gemm_lib() is not None:
        return "native"
    return "onednn" if fp32_cpu and onednn_available() else "torch"


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None, backend: str,
                  gate_up: bool = False) -> nn.Module:
    """A pre-packed replacement for ``nn.Linear(weight, bias)`` (``onednn`` or ``native``);
    ``gate_up`` fuses the SwiGLU activation where the backend can (native)."""
    if backend == "native":
        return NativeLinear(weight, bias, native_gemm_lib(), gate_up=gate_up)
    if backend == "onednn":
        return PackedLinear(weight, bias)
    raise ValueError(f"no packed linear for backend {backend!r}")


def pack_linears(model: nn.Module, backend: str = "onednn") -> int:
    """Replace every ``nn.Linear`` in ``model`` by a packed one; returns how many. With
    ``native``, every ``gate_up_proj`` also applies silu(gate) * up."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, packed_linear(child.weight, child.bias, backend,
                                                    gate_up=name == "gate_up_proj"))
                count += 1
    return count
