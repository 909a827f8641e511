"""PNG figures of bench runs (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
import os

from conveyor.bench.breakdown import ServiceTimeline
from conveyor.bench.metrics import RequestRecord, RunResult, Summary

_CDF_METRICS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E latency"))


def _pyplot():
    # matplotlib is an optional extra: only figures need it, so it is imported here.
    try:
        import matplotlib
    except ImportError:
        raise ImportError("figures (--plot) need matplotlib: pip install 'conveyor[plots]'"
                          ) from None

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


def plot_service_shares(panels: list[tuple[str, ServiceTimeline]], path: str,
                        groups: list | None = None, demand: dict | None = None,
                        last_arrival_s: float | None = None) -> str:
    """One panel per run: each group's share of service per time bin, stacked to 1.

    ``groups`` fixes the stacking order (default: sorted). ``demand`` (group -> fraction
    of requests) is drawn as dashed levels in that order, so a panel shows at a glance
    whether service follows the arrival mix (fcfs) or the fair share; a dotted line
    marks ``last_arrival_s``.
    """
    plt = _pyplot()
    if groups is None:
        groups = sorted({g for _, tl in panels for g in tl.service}, key=str)
    colors = {g: plt.get_cmap("tab10")(i % 10) for i, g in enumerate(groups)}
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), sharey=True,
                             squeeze=False)
    for ax, (title, tl) in zip(axes[0], panels):
        shares = tl.shares()
        ys = []
        for g in groups:
            values = [0.0 if math.isnan(v) else v for v in shares.get(g, [0.0] * len(tl.centers))]
            ys.append(values + values[-1:])  # one value per edge: the last bin drawn to its end
        ax.stackplot(tl.edges, ys, labels=[str(g) for g in groups],
                     colors=[colors[g] for g in groups], alpha=0.85, step="post")
        level = 0.0
        for g in groups if demand else ():
            level += demand.get(g, 0.0)
            ax.axhline(level, color="black", lw=0.8, ls="--")
        if last_arrival_s is not None:
            ax.axvline(last_arrival_s, color="black", lw=1.0, ls=":")
        ax.set_title(title)
        ax.set_xlabel("time since start (s)")
        ax.set_xlim(tl.edges[0], tl.edges[-1])
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("share of service (weighted tokens)")
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)
    notes = (["dashed: cumulative share of requests"] if demand else []) + \
        (["dotted: last arrival"] if last_arrival_s is not None else [])
    if notes:
        fig.text(0.01, 0.01, "; ".join(notes), fontsize=8)
    fig.tight_layout(rect=(0, 0.04 if notes else 0, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
