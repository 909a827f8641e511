"""Few-row calls of a projection through conveyor's GEMM, the rest through the backend
chosen for the model.

A decode step at batch 1 or 2 reads every weight once for one or two rows: it is bound by
memory, where the GEMM streaming a bf16 weight (float32 sums of the exact bf16 products,
rounded to bf16 once: the numbers of oneDNN's bf16 GEMM, in another order) can beat a
backend that wins at larger row counts. So a projection may keep both: ``RowSplitLinear``
sends calls of up to ``max_rows`` rows to the GEMM and the rest to the other backend, on a
second copy of the weight. Whether and up to how many rows is measured on the machine
(``autotune/few_rows.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from conveyor.model.linear.native import NativeLinear


class Bf16WeightGemm(nn.Module):
    """``x @ weight.T`` for bf16 x through conveyor's GEMM on the bf16 weight (float32
    arithmetic on bf16 values: the products exact, the sums float32), rounded to bf16."""

    applies_silu_mul = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.gemm = NativeLinear(weight.detach().to(torch.bfloat16), bias, lib,
                                 bf16_weight=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x.to(torch.float32)).to(x.dtype)


class RowSplitLinear(nn.Module):
    """Calls of up to ``max_rows`` rows to ``few``, the others to ``many`` (the same
    weight, packed twice)."""

    def __init__(self, few: nn.Module, many: nn.Module, max_rows: int) -> None:
        super().__init__()
        if getattr(many, "applies_silu_mul", False) or getattr(few, "applies_silu_mul", False):
            raise ValueError("a row split needs plain projections on both sides")
        self.few, self.many, self.max_rows = few, many, max_rows
        self.in_features, self.out_features = many.in_features, many.out_features
        self.applies_silu_mul = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.few(x) if x.shape[0] <= self.max_rows else self.many(x)

    def extra_repr(self) -> str:
        return f"up to {self.max_rows} rows to the first"


def few_row_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                   lib) -> nn.Module:
    """The GEMM's module for a projection of a ``dtype`` model: bf16 in and out on a bf16
    copy, or float32 (``NativeLinear``, plain: no fused activation)."""
    if dtype == torch.bfloat16:
        return Bf16WeightGemm(weight, bias, lib)
    return NativeLinear(weight.detach().to(torch.float32), bias, lib)
