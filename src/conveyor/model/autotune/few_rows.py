"""Whether, and up to how many rows, a projection's calls go to conveyor's GEMM on a
second copy of its weight (``linear/few_rows.RowSplitLinear``), measured on this machine.

A decode step at a few rows reads every weight once for one or two rows: it is bound by
memory, where the GEMM streaming the weight may beat the backend chosen for the larger
row counts of a server's cap. The second copy of every projection's weight is taken only
where the copies fit ``MAX_EXTRA_BYTES``, and only where it was measured on this CPU:
each row count of ``ROW_COUNTS`` below the decode rows the backend choice was timed at (a
server's ``max_num_seqs``), timed over the model's projections in layer order (as a
decode step reads them, see ``linears.rotation``), the two sides taking turns; the split
goes up to the row count where the GEMM's summed gain is largest (``split_rows``), where
it took at most ``WIN`` of the other's time at one count and lost by no more than ``TIE``
at any. ``CONVEYOR_FEW_ROWS=N`` forces a split at N rows (0: none). Cached in
``<cache>/few_rows_choice.json``.
"""

from __future__ import annotations

import logging
import time

import torch

from conveyor import envs
from conveyor.kernels.cpu.cpuinfo import cpu_model_name
from conveyor.model.autotune import cache as choice_cache
from conveyor.model.autotune.linears import (
    MEASURE_ROUNDS,
    _rotation_calls,
    _rotation_times,
    rotation,
)
from conveyor.model.linear.few_rows import few_row_linear
from conveyor.model.linear.shape import LinearShape

logger = logging.getLogger(__name__)

ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64)  # (those below the decode rows the choice timed)
WIN = 0.9  # the GEMM's share of the other's time, at most, at one row count: worth a copy
TIE = 1.1  # the GEMM's share of the other's time, at most, at every row count split
MAX_EXTRA_BYTES = 1 << 30  # the second copies of the weights, at most


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
    # a burst of load on a shared machine (seconds long) hits both sides alike.
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
