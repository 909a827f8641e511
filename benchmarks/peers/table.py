"""The peers table: per system, the median over runs of each figure, and ratios to conveyor.

Each figure is the median of its own values across runs (tokens/s of the 3 runs, TTFT
p50 of the 3 runs, ...), so one slow run moves nothing. Ratios are peer / conveyor:
tokens/s above 1 means the peer is faster; TTFT p99 above 1 means the peer answers
later than conveyor.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, fields
from typing import Any

BASELINE = "conveyor"


@dataclass
class RunFigures:
    """One run of the workload against one system (milliseconds for latencies)."""

    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    output_tokens: int
    completed: int
    failed: int
    duration_s: float

    @classmethod
    def from_summary(cls, s: dict[str, Any]) -> RunFigures:
        """From a conveyor bench summary (``Summary.to_dict()``, as saved with --out)."""
        lat = s["latency"]
        return cls(tokens_per_s=_num(s["output_throughput"]),
                   ttft_p50_ms=_num(lat["ttft"]["median"]), ttft_p99_ms=_num(lat["ttft"]["p99"]),
                   tpot_p50_ms=_num(lat["tpot"]["median"]), tpot_p99_ms=_num(lat["tpot"]["p99"]),
                   output_tokens=int(s["total_output_tokens"]),
                   completed=int(s["num_completed"]), failed=int(s["num_failed"]),
                   duration_s=_num(s["duration_s"]))


@dataclass
class SystemResult:
    """All runs of one system in one dtype, or why it has none."""

    system: str
    dtype: str
    runs: list[RunFigures] = field(default_factory=list)
    startup_s: float | None = None
    error: str | None = None
    note: str = ""

    def median(self) -> RunFigures | None:
        if not self.runs:
            return None
        values = {}
        for f in fields(RunFigures):
            xs = [getattr(r, f.name) for r in self.runs]
            finite = [x for x in xs if not math.isnan(x)]
            m = statistics.median(finite) if finite else math.nan
            values[f.name] = round(m) if f.type == "int" and not math.isnan(m) else m
        return RunFigures(**values)

    def to_dict(self) -> dict[str, Any]:
        med = self.median()
        return {"system": self.system, "dtype": self.dtype, "startup_s": self.startup_s,
                "error": self.error, "note": self.note,
                "runs": [asdict(r) for r in self.runs],
                "median": asdict(med) if med else None}


def ratio(value: float, baseline: float) -> float:
    """value / baseline; NaN when either is missing or the baseline is zero."""
    if value is None or baseline is None or math.isnan(value) or math.isnan(baseline) \
            or baseline == 0:
        return math.nan
    return value / baseline


def _num(x: Any) -> float:
    return math.nan if x is None else float(x)


def _fmt(x: float, digits: int = 0) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:,.{digits}f}"


def _fmt_ratio(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2f}x"


HEADER = ("system", "tokens/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
          "out tokens", "tok/s vs conveyor", "TTFT p99 vs conveyor")


def table_rows(results: list[SystemResult]) -> list[tuple[str, ...]]:
    """One row per system of one dtype; ratios against the conveyor row of that list."""
    base = next((r.median() for r in results if r.system == BASELINE), None)
    rows = []
    for res in results:
        med = res.median()
        if med is None:
            rows.append((res.system, f"failed: {res.error or 'no run'}", *[""] * 7))
            continue
        tok_ratio = ratio(med.tokens_per_s, base.tokens_per_s) if base else math.nan
        ttft_ratio = ratio(med.ttft_p99_ms, base.ttft_p99_ms) if base else math.nan
        out = f"{med.output_tokens:,}"
        if med.failed:
            out += f" ({med.failed} failed)"
        rows.append((res.system, _fmt(med.tokens_per_s, 1), _fmt(med.ttft_p50_ms),
                     _fmt(med.ttft_p99_ms), _fmt(med.tpot_p50_ms, 1), _fmt(med.tpot_p99_ms, 1),
                     out, _fmt_ratio(tok_ratio), _fmt_ratio(ttft_ratio)))
    return rows


def format_table(results: list[SystemResult], title: str = "") -> str:
    """A Markdown table (readable as plain text too)."""
    rows = [HEADER, *table_rows(results)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = [f"### {title}"] if title else []
    for n, row in enumerate(rows):
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if n == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    notes = [f"- {r.system}: {r.note}" for r in results if r.note]
    return "\n".join(lines + notes)
