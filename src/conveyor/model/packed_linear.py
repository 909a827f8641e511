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
from collections.abc import Callable

import torch
from torch import nn

from conveyor.model import kernels
from conveyor.model.kernels import ops as native

logger = logging.getLogger(__name__)


def __getattr__(name: str):
    if name == "LINEAR_BACKENDS":  # the names linear_backend takes, as registered now
        from conveyor.model.backends import linear_backend_names

        return ("auto", *linear_backend_names())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    return lib if lib is not None and native.gemm_available() else None


class NativeLinear(nn.Module):
    """``x @ weight.T + bias`` through ``kernels/gemm.c`` with the weight packed once
    (``kernels.ops.PackedGemm``: checked once, and each input on every call).

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


def pick_linear_backend(backend: str, device: torch.device, dtype: torch.dtype,
                        weight_dtype: torch.dtype | None = None) -> str:
    """Which linears a model gets, by name: ``native`` (conveyor's GEMM), ``onednn``,
    ``torch`` (plain ``F.linear``), any registered one, or ``auto``: the first registered
    that applies (native for float32 on an AVX2 CPU, else oneDNN for float32 on CPU where
    torch has it, else torch). See ``backends.py``."""
    from conveyor.model.backends import select_linear_backend

    return select_linear_backend(backend, device, dtype, weight_dtype).name


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None, backend: str,
                  gate_up: bool = False) -> nn.Module:
    """A pre-packed replacement for ``nn.Linear(weight, bias)`` from linear backend
    ``backend`` (``onednn``, ``native``, ...); ``gate_up`` fuses the SwiGLU activation
    where the backend can (native: check the module's ``applies_silu_mul``)."""
    from conveyor.model.backends import linear_backend

    cls = linear_backend(backend)
    if not cls.packs:
        raise ValueError(f"no packed linear for backend {backend!r}")
    return cls(weight.device, weight.dtype).make_linear(weight, bias, gate_up=gate_up)


def pack_linears_by(model: nn.Module, backend_of: Callable[[str, torch.Tensor], str],
                    few_rows: int = 0, lib=None) -> int:
    """Replace each ``nn.Linear`` by the packed one of ``backend_of(name, weight)`` (a
    backend that does not pack, ``torch``, keeps it); returns how many were packed. With
    ``few_rows``, calls of up to that many rows go to conveyor's GEMM on a copy of the
    weight (``few_rows.RowSplitLinear``; ``lib``: the kernels with the GEMM), unless the
    projection is the GEMM's already."""
    from conveyor.model.backends import linear_backend
    from conveyor.model.few_rows import RowSplitLinear, few_row_linear

    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                backend = backend_of(name, child.weight)
                module: nn.Module = child
                if linear_backend(backend).packs:
                    module = packed_linear(child.weight, child.bias, backend,
                                           gate_up=name == "gate_up_proj")
                    count += 1
                if (few_rows > 0 and not isinstance(module, NativeLinear)
                        and not getattr(module, "applies_silu_mul", False)):
                    module = RowSplitLinear(few_row_linear(child.weight, child.bias,
                                                           child.weight.dtype, lib),
                                            module, few_rows)
                if module is not child:
                    setattr(parent, name, module)
    return count


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
