"""A backend per row range for one weight shape: the one-row winner for calls of up to a
measured row count, the larger calls' winner past it.

``linears.choose`` times a shape's backends at a server's decode rows (``max_num_seqs``)
and at prefill rows and picks one for every call. A backend that wins there can lose by
far at one row: dequantising a quantized weight before a GEMM costs the same at one row
as at a hundred, while a kernel that widens the weight in registers streams it once. A
decode step at batch 1 would pay the large calls' winner in full. So the choice is made
per row range: the larger calls' winner as before; the one-row winner, timed at one row
(the same measurement and cache, at (1, 1) rows); where they differ, both timed at each
of ``SPLIT_ROWS`` below the decode rows (as ``few_rows`` does: the server's decode rows
are the larger calls' winner's, timed there), the one-row winner taking calls up to the
row count ``few_rows.split_rows`` picks (the rule the float GEMM's few-row split follows:
largest summed gain, a clear win somewhere, no loss past ``TIE``), 0 where it keeps none.
Cached in ``<cache>/row_ranges_choice.json``.

At the rows the fused decode step takes (``fused_calls.ROWS_CAP``) the step calls the
projections from C, not through their modules: where the one-row winner is a backend it
calls, the one-row winner among those it calls is the one fastest timed as it calls them
(``fused_calls.measure``, cached in ``<cache>/fused_one_row_choice.json``), and the split
times both sides that way at those row counts (a backend the step cannot call is still
judged by its module's time: its step would run the modules).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from conveyor.kernels.cpu.cpuinfo import cpu_model_name
from conveyor.model.autotune import cache as choice_cache
from conveyor.model.autotune import fused_calls, linears
from conveyor.model.autotune.few_rows import TIE, WIN, split_rows
from conveyor.model.linear.shape import LinearShape

logger = logging.getLogger(__name__)

SPLIT_ROWS = (2, 4, 8, 16, 32, 64)  # row counts past one where the two winners are timed


@dataclass(frozen=True)
class RowRanges:
    """Calls of up to ``few_rows`` rows to ``few``, the others to ``many`` (``few_rows``
    0: ``many`` for every call)."""

    few: str
    few_rows: int
    many: str

    @property
    def names(self) -> set[str]:
        return {self.many, self.few} if self.few_rows else {self.many}


def choose(shapes: list[LinearShape], backends: dict[str, object], device: torch.device,
           dtype: torch.dtype, decode_rows: int, prefill_rows: int,
           counts: dict[str, int] | None = None) -> dict[str, RowRanges]:
    """Shape key -> its backends by row range (``backends``, ``counts``: as
    ``linears.choose`` takes them)."""
    many = linears.choose(shapes, backends, device, dtype, decode_rows, prefill_rows, counts)
    few = _fused_one_row(shapes, backends, dtype, counts,
                         linears.choose(shapes, backends, device, dtype, 1, 1, counts))
    out = {k: RowRanges(v, 0, v) for k, v in many.items()}
    pairs: dict[tuple[str, str], list[LinearShape]] = {}
    for s in shapes:
        if few[s.key] != many[s.key]:
            pairs.setdefault((few[s.key], many[s.key]), []).append(s)
    cap = max(1, min(decode_rows, prefill_rows, linears.PREFILL_ROWS_CAP))
    row_counts = tuple(r for r in SPLIT_ROWS if r < cap)
    for (f, m), group in pairs.items():
        rows = _split(group, f, m, {f: backends[f], m: backends[m]}, device, dtype,
                      row_counts, counts)
        for s in group:
            out[s.key] = RowRanges(f, rows[s.key], m)
    return out


def _fused_one_row(shapes: list[LinearShape], backends: dict[str, object],
                   dtype: torch.dtype, counts: dict[str, int] | None, few: dict[str, str]
                   ) -> dict[str, str]:
    """``few`` (shape key -> the one-row winner timed through the modules) with each
    projection whose winner the fused step calls given the backend fastest among those it
    calls, timed as it calls them; cached or measured."""
    counts = counts or {}
    key = choice_cache.key(str(dtype), ",".join(backends), ",".join(
        f"{s.key}*{counts.get(s.key, 1)}" for s in shapes), "fused step, 1 row",
        choice_cache.kernel_build())
    entry = choice_cache.read("fused_one_row").get(key)
    if entry is not None:
        times = entry["timings_s"]
    else:
        t0 = time.perf_counter()
        times = fused_calls.measure(shapes, backends, dtype, 1, counts) or {}
        logger.info("one-row backends timed as the fused step calls them in %.1f s on %s; "
                    "ms a call: %s", time.perf_counter() - t0, cpu_model_name(),
                    {k: {n: round(1e3 * x, 4) for n, x in v.items()}
                     for k, v in times.items()})
        choice_cache.store("fused_one_row", key, {"cpu": cpu_model_name(),
                                                  "timings_s": times})
    out = dict(few)
    for k, t in times.items():
        if few.get(k) in t:
            out[k] = min(t, key=t.__getitem__)
    return out


def _split(shapes: list[LinearShape], few: str, many: str, backends: dict[str, object],
           device: torch.device, dtype: torch.dtype, row_counts: tuple[int, ...],
           counts: dict[str, int] | None) -> dict[str, int]:
    """Shape key -> the rows up to which ``few`` takes the calls, cached or measured: each
    of ``row_counts`` in turn over the shapes still in play (one whose ``few`` lost by
    more than ``TIE`` at a count is timed no further)."""
    counts = counts or {}
    key = choice_cache.key(str(dtype), few, many, ",".join(
        f"{s.key}*{counts.get(s.key, 1)}" for s in shapes), repr(row_counts), str(WIN),
        str(TIE), f"fused step up to {fused_calls.ROWS_CAP} rows",
        choice_cache.kernel_build())
    entry = choice_cache.read("row_ranges").get(key)
    if entry is not None and set(entry["rows"]) == {s.key for s in shapes}:
        logger.info("row ranges (cached for this CPU): %s up to %s rows, then %s", few,
                    entry["rows"], many)
        return {k: int(v) for k, v in entry["rows"].items()}
    t0 = time.perf_counter()
    times: dict[str, dict[int, tuple[float, float]]] = {s.key: {} for s in shapes}
    live = list(shapes)
    for r in (1, *row_counts):
        if not live:
            break
        # (as the fused step calls them at its rows, if it calls both; else the modules)
        native = (fused_calls.measure(live, backends, dtype, r, counts)
                  if r <= fused_calls.ROWS_CAP else None) or {}
        rest = [s for s in live if s.key not in native]
        measured = linears.measure(rest, backends, device, dtype, r, r, counts) if rest \
            else {}
        for s in list(live):
            t = ((native[s.key][few], native[s.key][many]) if s.key in native
                 else (measured[s.key][few][0], measured[s.key][many][0]))
            times[s.key][r] = t
            if t[0] > TIE * t[1]:
                live.remove(s)
    rows = {k: split_rows(t) for k, t in times.items()}
    logger.info("row ranges measured in %.1f s on %s: %s up to %s rows, then %s; ms a call "
                "(%s, %s): %s", time.perf_counter() - t0, cpu_model_name(), few, rows,
                many, few, many,
                {k: {r: tuple(round(1e3 * x, 3) for x in v) for r, v in t.items()}
                 for k, t in times.items()})
    choice_cache.store("row_ranges", key, {"rows": rows, "cpu": cpu_model_name(),
                                           "timings_s": times})
    return rows
