"""Tables, JSON files and run-to-run comparison of bench summaries."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from conveyor.bench.metrics import LATENCY_METRICS, RunResult, Summary

_LATENCY_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E",
                   "queue": "queue time"}


def figures(summary: Summary) -> dict[str, tuple[str, float | None]]:
    """Ordered key -> (label, value) of every reported figure."""
    s = summary
    out: dict[str, tuple[str, float | None]] = {
        "completed": ("completed requests", s.num_completed),
        "failed": ("failed requests", s.num_failed),
        "duration_s": ("duration (s)", s.duration_s),
        "request_throughput": ("requests/s", s.request_throughput),
        "input_throughput": ("input tokens/s", s.input_throughput),
        "output_throughput": ("output tokens/s", s.output_throughput),
        "goodput": ("goodput (req/s in SLO)", s.goodput),
    }
    for key, label, value in (("slo_attainment", "SLO attainment (%)", s.slo_attainment),
                              ("ttft_attainment", "TTFT attainment (%)", s.ttft_attainment),
                              ("tpot_attainment", "TPOT attainment (%)", s.tpot_attainment)):
        if value is not None:
            out[key] = (label, 100 * value)
    if s.extra.get("num_slo_rejected"):
        out["num_slo_rejected"] = ("rejected early (SLO)", s.extra["num_slo_rejected"])
    for name in LATENCY_METRICS:
        stats = s.latency.get(name)
        if stats is None or stats.count == 0:
            continue
        label = _LATENCY_LABELS[name]
        for stat in ("mean", "median", "p90", "p99"):
            out[f"{name}_{stat}_ms"] = (f"{label} {stat} (ms)", getattr(stats, stat))
    out["preemptions"] = ("preemptions", s.num_preemptions)
    out["peak_kv_usage"] = ("peak KV usage (%)",
                            None if s.peak_kv_usage is None else 100 * s.peak_kv_usage)
    for key in ("num_steps", "mean_batch_size"):
        if key in s.extra:
            out[key] = (key.replace("num_", "").replace("_", " "), s.extra[key])
    for key, label in (("spec_draft_tokens", "draft tokens verified"),
                       ("spec_acceptance_rate", "draft acceptance rate"),
                       ("spec_mean_acceptance_length", "mean acceptance length")):
        if key in s.extra:
            out[key] = (label, s.extra[key])
    budget = s.extra.get("token_budget") or {}
    if budget.get("mode") == "slo" and budget.get("num_steps"):
        out["budget_time_bound"] = ("steps cut by the SLO budget (%)",
                                    100 * budget["num_time_bound"] / budget["num_steps"])
    return out


def fmt(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, int):
        return str(value)
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def ratio(a: float | None, b: float | None) -> float | None:
    """b / a, or None when either is missing or a is zero."""
    if a is None or b is None or a == 0 or math.isnan(a) or math.isnan(b):
        return None
    return b / a


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(h).ljust(w) if i == 0 else str(h).rjust(w)
                       for i, (h, w) in enumerate(zip(header, widths)))]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w)
                               for i, (x, w) in enumerate(zip(row, widths))))
    return "\n".join(lines)


def format_summary(summary: Summary, title: str = "") -> str:
    rows = [[label, fmt(value)] for label, value in figures(summary).values()]
    return table([title or "metric", "value"], rows)


def format_comparison(summaries: dict[str, Summary], title: str = "metric") -> str:
    """One column per run and, for two runs, a ratio column (second / first)."""
    labels = list(summaries)
    figs = {label: figures(s) for label, s in summaries.items()}
    keys = list(dict.fromkeys(k for f in figs.values() for k in f))
    header = [title, *labels]
    if len(labels) == 2:
        header.append(f"{labels[1]}/{labels[0]}")
    rows = []
    for key in keys:
        name = next(f[key][0] for f in figs.values() if key in f)
        values = [figs[label].get(key, (name, None))[1] for label in labels]
        row = [name, *(fmt(v) for v in values)]
        if len(labels) == 2:
            r = ratio(values[0], values[1])
            row.append("-" if r is None else f"{r:.2f}x")
        rows.append(row)
    return table(header, rows)


# ---- files --------------------------------------------------------------------------------
def save_json(path: str, results: list[RunResult], config: dict[str, Any],
              extra: dict[str, Any] | None = None) -> None:
    doc = {"config": config, "runs": [{"label": r.label, "summary": r.summary.to_dict()}
                                      for r in results]}
    doc.update(extra or {})
    _makedirs_for(path)
    with open(path, "w") as f:
        json.dump(_clean(doc), f, indent=1)


def save_records(path: str, results: list[RunResult]) -> None:
    """One JSON object per request, tagged with its run's label."""
    _makedirs_for(path)
    with open(path, "w") as f:
        for result in results:
            for rec in result.records:
                f.write(json.dumps(_clean({"run": result.label, **rec.to_dict()})) + "\n")


def load_summaries(path: str) -> dict[str, Summary]:
    try:
        with open(path) as f:
            doc = json.load(f)
        return {run["label"]: Summary.from_dict(run["summary"]) for run in doc["runs"]}
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a conveyor bench result file ({e})") from None


def compare_files(path_a: str, path_b: str) -> str:
    """Ratios B/A for every run label the two files share (or their only runs)."""
    a, b = load_summaries(path_a), load_summaries(path_b)
    pairs = [(label, a[label], b[label]) for label in a if label in b]
    if not pairs and len(a) == 1 and len(b) == 1:
        pairs = [(f"{next(iter(a))} vs {next(iter(b))}", *a.values(), *b.values())]
    if not pairs:
        raise ValueError(f"{path_a} and {path_b} share no run label "
                         f"({', '.join(a)} vs {', '.join(b)})")
    parts = [f"A = {path_a}\nB = {path_b}"]
    for label, sa, sb in pairs:
        parts.append(f"run {label}:\n" + format_comparison({"A": sa, "B": sb}))
    return "\n\n".join(parts)


def _makedirs_for(path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)


def _clean(obj: Any) -> Any:
    """Strict JSON: NaN becomes null and infinities "inf"/"-inf"."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    return obj
