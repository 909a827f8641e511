"""Static against continuous batching: the same workload through both, side by side.

Shared by ``conveyor bench`` (its main job), ``benchmarks/scheduling/batching.py`` and
``benchmarks/scheduling/static_vs_continuous.py``. The modes alternate (static, continuous,
continuous, static, ...) so that a drift in machine load hits both alike; each run
gets a fresh engine. The figure reported per mode is its median-throughput run.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from conveyor.bench.engine_backend import run_engine
from conveyor.bench.ideal import (
    IdealRatios,
    StepCosts,
    default_batch_sizes,
    ideal_ratios,
    measure_step_costs,
)
from conveyor.bench.metrics import RunResult, Summary
from conveyor.bench.report import fmt, format_comparison, table
from conveyor.bench.workload import BenchRequest
from conveyor.config import EngineArgs

MODES = ("static", "continuous")


@dataclass
class BatchingComparison:
    runs: dict[str, list[RunResult]]  # mode -> one result per repeat, in run order
    ideal: IdealRatios
    costs: StepCosts | None = None  # measured before the runs
    run_costs: StepCosts | None = None  # seen in the runs' decode steps

    def representative(self, mode: str) -> RunResult:
        """The run with the median output throughput (the lower one for an even count)."""
        runs = sorted(self.runs[mode], key=lambda r: r.summary.output_throughput)
        return runs[(len(runs) - 1) // 2]

    def summaries(self) -> dict[str, Summary]:
        return {mode: self.representative(mode).summary for mode in self.runs}

    def throughputs(self, mode: str) -> list[float]:
        return [r.summary.output_throughput for r in self.runs[mode]]

    @property
    def throughput_ratio(self) -> float:
        """Continuous over static generated tokens/s (medians over repeats)."""
        return (statistics.median(self.throughputs("continuous"))
                / statistics.median(self.throughputs("static")))

    def ttft_ratio(self, stat: str) -> float | None:
        """Static over continuous TTFT (``median`` or ``p99``): above 1, continuous is faster."""
        s = self.summaries()
        a = getattr(s["static"].latency["ttft"], stat)
        b = getattr(s["continuous"].latency["ttft"], stat)
        return a / b if b else None

    def headline(self) -> dict[str, float | None]:
        ideal = self.ideal
        out = {"throughput_ratio": self.throughput_ratio,
               "ttft_p50_ratio_static_over_continuous": self.ttft_ratio("median"),
               "ttft_p99_ratio_static_over_continuous": self.ttft_ratio("p99"),
               "slot_ideal": ideal.slot_ideal, "packing_bound": ideal.packing_bound,
               "cost_ideal": ideal.cost_ideal,
               "cost_ideal_with_prefill": ideal.cost_ideal_with_prefill,
               "cost_ideal_in_run": ideal.cost_ideal_in_run}
        return out

    def format(self) -> str:
        parts = [format_comparison(self.summaries())]
        rows = [[mode, " ".join(fmt(t) for t in self.throughputs(mode))] for mode in self.runs]
        parts.append(table(["output tokens/s per repeat", "in run order"], rows))
        parts.append(format_ideal(self.ideal, self.throughput_ratio, self.costs,
                                  self.run_costs))
        return "\n\n".join(parts)


def format_ideal(ideal: IdealRatios, measured: float, costs: StepCosts | None,
                 run_costs: StepCosts | None = None) -> str:
    rows = [["measured (continuous/static tokens/s)", f"{measured:.2f}x", ""]]

    def add(name: str, value: float | None) -> None:
        if value is not None:
            rows.append([name, f"{value:.2f}x", f"{100 * measured / value:.0f}%"])

    add("slot ideal (static/continuous steps)", ideal.slot_ideal)
    add("packing bound (static slot-steps/token)", ideal.packing_bound)
    add("cost ideal (decode steps x step time)", ideal.cost_ideal)
    add("cost ideal incl. equal prefill work", ideal.cost_ideal_with_prefill)
    add("cost ideal, step times seen in the runs", ideal.cost_ideal_in_run)
    text = table(["continuous over static", "ratio", "measured/ideal"], rows)
    text += (f"\npaper replay with {ideal.max_num_seqs} slots: static {ideal.static_steps} "
             f"steps, continuous {ideal.continuous_steps} steps, {ideal.useful_tokens} "
             "tokens")
    if costs is not None:
        text += (f"\ndecode step ms by batch size, measured first: {_curve(costs)}; "
                 f"prefill {1e6 * costs.prefill_s_per_token:.1f} us/prompt token")
    if run_costs is not None:
        text += f"\ndecode step ms by batch size, seen in the runs: {_curve(run_costs)}"
    return text


def _curve(costs: StepCosts) -> str:
    return ", ".join(f"{b}:{1e3 * s:.1f}" for b, s in zip(costs.batch_sizes, costs.decode_s))


def compare_batching(requests: list[BenchRequest], engine_args: EngineArgs, *,
                     repeats: int = 1, measure_costs: bool = True,
                     cost_context_len: int | None = None, progress: bool = True,
                     log=print) -> BatchingComparison:
    """Run both modes ``repeats`` times each, alternating, after measuring step costs."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    costs = None
    if measure_costs:
        # A decode step's context: a typical prompt plus half a typical output.
        context = cost_context_len or round(
            statistics.fmean(r.prompt_len for r in requests)
            + statistics.fmean(r.output_len for r in requests) / 2)
        sizes = default_batch_sizes(engine_args.max_num_seqs)
        log(f"measuring decode step time at batch sizes {sizes} "
            f"(contexts of {context} tokens)...")
        costs = measure_step_costs(engine_args, sizes, context)
    runs: dict[str, list[RunResult]] = {mode: [] for mode in MODES}
    for rep in range(repeats):
        order = MODES if rep % 2 == 0 else MODES[::-1]
        for mode in order:
            args = dataclasses.replace(engine_args, batching=mode)
            result = run_engine(requests, args, label=f"{mode} {rep + 1}/{repeats}",
                                progress=progress)
            result.label = mode
            runs[mode].append(result)
            s = result.summary
            log(f"  {mode:<10} run {rep + 1}/{repeats}: {s.output_throughput:8.1f} output "
                f"tokens/s, {s.duration_s:6.2f}s, {s.extra.get('num_steps')} steps")
            if s.num_failed:
                first = next(r.error for r in result.records if r.error)
                log(f"  {s.num_failed} requests failed, first: {first}")
    trace = [step for results in runs.values() for r in results for step in r.step_trace]
    run_costs = StepCosts.from_step_trace(trace)
    ideal = ideal_ratios(requests, engine_args.max_num_seqs, costs, run_costs)
    return BatchingComparison(runs, ideal, costs, run_costs)


def headline_row(name: str, cmp: BatchingComparison) -> list[str]:
    """name, static and continuous tokens/s, their ratio, and the ratio against each ideal."""
    h = cmp.headline()
    measured = h["throughput_ratio"]

    def pct(key: str) -> str:
        value = h[key]
        return "-" if value is None else f"{value:.2f}x ({100 * measured / value:.0f}%)"

    return [name, fmt(statistics.median(cmp.throughputs("static"))),
            fmt(statistics.median(cmp.throughputs("continuous"))), f"{measured:.2f}x",
            pct("slot_ideal"), pct("cost_ideal"), pct("cost_ideal_with_prefill"),
            pct("cost_ideal_in_run")]


HEADLINE_HEADER = ["", "static tok/s", "continuous tok/s", "ratio", "slot ideal (reached)",
                   "cost ideal (reached)", "cost ideal+prefill", "cost ideal in-run"]
