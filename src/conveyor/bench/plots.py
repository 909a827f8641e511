"""PNG figures of bench runs (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
import os

from conveyor.bench.metrics import RequestRecord, RunResult, Summary

_CDF_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E latency"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _samples(records: list[RequestRecord], metric: str) -> list[float]:
    done = [r for r in records if r.ok]
    if metric == "itl":
        return [1e3 * x for r in done for x in r.itls_s]
    values = (getattr(r, f"{metric}_s") for r in done)
    return [1e3 * v for v in values if v is not None]


def plot_latency_cdfs(results: list[RunResult], path: str) -> str:
    """One panel per latency metric, one line per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (metric, title) in zip(axes.flat, _CDF_METRICS):
        for result in results:
            xs = sorted(_samples(result.records, metric))
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=result.label)
        ax.set_title(f"{title} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of tokens")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_rate_sweep(points: list[tuple[float, Summary]], path: str) -> str:
    """Output tokens/s and p99 TTFT against the request rate (inf drawn at the right end)."""
    plt = _pyplot()
    finite = [r for r, _ in points if not math.isinf(r)]
    inf_x = max(finite) * 1.5 if finite else 1.0
    xs = [inf_x if math.isinf(r) else r for r, _ in points]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(xs, [s.output_throughput for _, s in points], "o-")
    ax1.set_ylabel("output tokens/s")
    ax2.plot(xs, [s.latency["ttft"].p99 for _, s in points], "o-", color="tab:red")
    ax2.set_ylabel("p99 TTFT (ms)")
    for ax in (ax1, ax2):
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        if any(math.isinf(r) for r, _ in points):
            ticks = [*finite, inf_x]
            ax.set_xticks(ticks, [f"{t:g}" for t in finite] + ["inf"])
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
