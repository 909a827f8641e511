"""Few-row calls of a model's projections through conveyor's GEMM, where that measured
faster than the backend chosen for the rest.

A decode step at batch 1 or 2 reads every weight once for one or two rows: it is bound by
memory, and on a Zen 4 oneDNN's bf16 kernels stream a weight at 15-19 GB/s there against
24 GB/s for ``kernels/gemm.c`` reading the same bf16 weight (float32 sums of the exact
bf16 products, rounded to bf16 once: the numbers of oneDNN's bf16 GEMM, in another
order). From 4 rows on oneDNN's bf16 dot products win (1.5x at 4 rows, 2.2x at 32). In
float32 the GEMM beat oneDNN at batch 1 too, where oneDNN was chosen for the larger row
counts of a server's cap. So a projection may keep both: ``RowSplitLinear`` sends calls
of up to ``max_rows`` rows to the GEMM and the rest to the chosen backend. That costs a
second copy of every projection's weight, so it is taken only where the copies fit
``MAX_EXTRA_BYTES``, and only where it was measured on this CPU: each row count of
``ROW_COUNTS`` below the decode rows the backend choice was timed at (a server's
``max_num_seqs``), timed over the model's projections in layer order (as a decode step
reads them, see ``linear_choice.rotation``), the two sides taking turns; the split goes
up to the row count where the GEMM's summed gain is largest (``split_rows``), where it
took at most ``WIN`` of the other's time at one count and lost by no more than ``TIE`` at
any. In float32 the split can reach past a few rows: since the GEMM prefetches its next
weight slice it beats oneDNN from 8 rows to 64 on a Zen 4 (1.14x at 32), while the two
tie at a server's cap of 128 rows, which either may win. ``CONVEYOR_FEW_ROWS=N`` forces
a split at N rows (0: none).
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from conveyor import envs
from conveyor.model import choice_cache
from conveyor.model.dtypes import cpu_model_name
from conveyor.model.linear_choice import (
    MEASURE_ROUNDS,
    LinearShape,
    _rotation_calls,
    _rotation_times,
    rotation,
)

logger = logging.getLogger(__name__)

ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64)  # (those below the decode rows the choice timed)
WIN = 0.9  # the GEMM's share of the other's time, at most, at one row count: worth a copy
TIE = 1.1  # the GEMM's share of the other's time, at most, at every row count split
MAX_EXTRA_BYTES = 1 << 30  # the second copies of the weights, at most


class Bf16WeightGemm(nn.Module):
    """``x @ weight.T`` for bf16 x through conveyor's GEMM on the bf16 weight (float32
    arithmetic on bf16 values: the products exact, the sums float32), rounded to bf16."""

    applies_silu_mul = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lib) -> None:
        super().__init__()
        from conveyor.model.packed_linear import NativeLinear

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


def split_rows(times: dict[int, tuple[float, float]]) -> int:
    """The row count up to which the GEMM (first of each pair) takes the calls: of the
    counts up to the first where it lost by more than ``TIE``, the one up to which its
    summed gain (1 - its time over the other's, a count each) is largest, if it won by
    ``WIN`` at one of them; else 0. A loss within ``TIE`` (noise, on a shared machine) does
    not end the split where larger counts win back more."""
    best, best_gain, gain, won = 0, 0.0, 0.0, False
    for r in sorted(times):
        gemm, other = times[r]
        if gemm > TIE * other:
            break
        gain += 1.0 - gemm / other
        won = won or gemm <= WIN * other
        if won and gain > best_gain:
            best, best_gain = r, gain
    return best


def forced_rows() -> int | None:
    return envs.few_rows()


def extra_bytes(counts: dict[LinearShape, int], itemsize: int = 2) -> int:
    """The second copies' bytes: every projection's weight (not the LM head)."""
    return sum(itemsize * s.out_features * s.in_features * n for s, n in counts.items()
               if not s.lm_head)


def few_row_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype,
                   lib) -> nn.Module:
    """The GEMM's module for a projection of a ``dtype`` model: bf16 in and out on a bf16
    copy, or float32 (``NativeLinear``, plain: no fused activation)."""
    if dtype == torch.bfloat16:
        return Bf16WeightGemm(weight, bias, lib)
    from conveyor.model.packed_linear import NativeLinear

    return NativeLinear(weight.detach().to(torch.float32), bias, lib)


class _Adapter:
    def __init__(self, make) -> None:
        self.make_linear = make


@torch.inference_mode()
def measure(shapes: list[LinearShape], counts: dict[str, int], many_backend, lib,
            dtype: torch.dtype = torch.bfloat16, row_counts: tuple[int, ...] = ROW_COUNTS
            ) -> dict[int, tuple[float, float]]:
    """Row count -> (the GEMM's, the other backend's) seconds for one pass over the
    model's projections, each timed in the rotation."""
    gen = torch.Generator().manual_seed(0)
    # A plain projection on both sides (gate/up's activation follows apart in the model).
    plain = {s.key: LinearShape(s.out_features, s.in_features) for s in shapes}
    weights = {p.key: (torch.randn(p.out_features, p.in_features, generator=gen) * 0.02).to(
        dtype) for p in plain.values()}
    order = [plain[s.key] for s in rotation(shapes, counts, dtype.itemsize)]
    few = _Adapter(lambda w, b, gate_up=False: few_row_linear(w, b, dtype, lib))
    xs = {r: {p.key: torch.randn(r, p.in_features, generator=gen).to(dtype)
              for p in plain.values()} for r in row_counts}
    out = {r: [float("inf"), float("inf")] for r in row_counts}
    # Both sides packed at once (two rotations: 2 x ROTATION_BYTES at most), taking turns
    # at each row count, MEASURE_ROUNDS each in alternating order, each side's best kept:
    # a burst of load on a shared machine (seconds long; it once made the GEMM measure
    # 1.15x slower than oneDNN at batch 1 where a decode step ran 1.2x faster with it)
    # hits both sides alike.
    calls = [_rotation_calls(backend, order, weights) for backend in (few, many_backend)]
    for r in row_counts:
        for round_ in range(MEASURE_ROUNDS):
            for side in ((0, 1) if round_ % 2 == 0 else (1, 0)):
                per_call = _rotation_times(calls[side], xs[r])
                out[r][side] = min(out[r][side], sum(
                    per_call[plain[s.key].key] * counts.get(s.key, 1) for s in shapes))
    return {r: (t[0], t[1]) for r, t in out.items()}


def choose(counts: dict[LinearShape, int], many_name: str, many_backend, lib,
           dtype: torch.dtype = torch.bfloat16, decode_rows: int | None = None) -> int:
    """The largest row count the GEMM takes (0: no split), forced, cached or measured:
    ``ROW_COUNTS`` below ``decode_rows`` (those the backend choice was timed at)."""
    forced = forced_rows()
    if forced is not None:
        return max(forced, 0)
    need = extra_bytes(counts, dtype.itemsize)
    if need > MAX_EXTRA_BYTES:
        logger.info("few-row GEMM not considered: a second copy of the weights would take "
                    "%.1f GiB (at most %.1f)", need / 2**30, MAX_EXTRA_BYTES / 2**30)
        return 0
    shapes = sorted((s for s in counts if not s.lm_head), key=lambda s: s.key)
    by_key = {s.key: n for s, n in counts.items() if not s.lm_head}
    row_counts = tuple(r for r in ROW_COUNTS if decode_rows is None or r < decode_rows)
    if not row_counts:
        return 0
    key = choice_cache.key(str(dtype), many_name, ",".join(f"{k}*{n}" for k, n in
                                                       sorted(by_key.items())),
                           repr(row_counts), str(WIN), str(TIE), "largest gain, turns",
                           choice_cache.kernel_build())
    entry = choice_cache.read("few_rows").get(key)
    if entry is not None:
        logger.info("few-row GEMM (cached for this CPU): up to %d rows", entry["rows"])
        return int(entry["rows"])
    t0 = time.perf_counter()
    times = measure(shapes, by_key, many_backend, lib, dtype, row_counts)
    rows = split_rows(times)
    logger.info("few-row GEMM measured in %.1f s on %s: up to %d rows against %s; ms a "
                "pass (GEMM, %s): %s", time.perf_counter() - t0, cpu_model_name(), rows,
                many_name, many_name,
                {r: tuple(round(1e3 * x, 2) for x in t) for r, t in times.items()})
    choice_cache.store("few_rows", key, {"rows": rows, "cpu": cpu_model_name(),
                                         "timings_s": times})
    return rows
