"""End to end: workloads replayed through the in-process engine, and the CLI around it."""

from __future__ import annotations

import json
import os

import pytest

from conveyor.bench.batching import compare_batching
from conveyor.bench.cli import MAIN_JOB_ARGV, _is_bare, _standalone_parser
from conveyor.bench.engine_backend import run_engine
from conveyor.bench.ideal import measure_step_costs
from conveyor.bench.workload import BenchRequest, build_requests
from conveyor.config import EngineArgs
from conveyor.entrypoints.cli import build_parser, main

from helpers import cpu_threads

DATA = os.path.join(os.path.dirname(__file__), "data")


def tiny_args(**kw) -> EngineArgs:
    base = dict(model="tiny", load_format="dummy", dtype="float32", max_num_seqs=4,
                max_num_batched_tokens=256, num_threads=cpu_threads())
    base.update(kw)
    return EngineArgs(**base)


def small_workload(n: int = 10, seed: int = 0) -> list[BenchRequest]:
    from conveyor.bench.traces import TraceRow

    rows = [TraceRow(0.0, 8 + 5 * (i % 4), 1 + (7 * i) % 9) for i in range(n)]
    return build_requests(rows, vocab_size=2048, seed=seed, tenants={"a": 1, "b": 1})


def test_engine_run_completes_with_forced_lengths():
    reqs = small_workload()
    result = run_engine(reqs, tiny_args(), progress=False)
    assert [r.request_id for r in result.records] == [r.request_id for r in reqs]
    for req, rec in zip(reqs, result.records):
        assert rec.ok, rec.error
        assert rec.output_tokens == req.output_len  # ignore_eos + max_tokens forced it
        assert rec.prompt_tokens == req.prompt_len
        assert rec.tenant == req.tenant
        assert 0 <= rec.queue_s <= rec.ttft_s <= rec.e2e_s
        assert len(rec.itls_s) == req.output_len - 1
    s = result.summary
    assert s.num_completed == len(reqs)
    assert s.total_output_tokens == sum(r.output_len for r in reqs)
    assert 0 < s.peak_kv_usage <= 1
    assert s.extra["num_steps"] == len(result.step_batch_sizes)
    assert max(result.step_batch_sizes) <= 4


class IdleClock:
    """An engine clock that only the replay's idle waits move: the run's timestamps are
    then exact, whatever the machine's speed (each step takes no time on it)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_engine_run_honours_arrival_times_and_reports_bad_requests():
    from conveyor.engine.llm_engine import LLMEngine

    reqs = small_workload(4)
    reqs[2].arrival_s = 0.4
    reqs[3].prompt_token_ids = [16] * 5000  # longer than the KV pool allows
    clock = IdleClock()
    engine = LLMEngine(tiny_args(num_kv_blocks=64), clock=clock)
    result = run_engine(reqs, engine=engine, progress=False, sleep=clock.sleep)
    late = result.records[2]
    assert late.ok and late.arrival_s == pytest.approx(0.4)
    # The others are done at 0 s: the run waits idle until 0.4 s, then serves the late one
    # at once. Its TTFT is measured from its own arrival, not from the run's start.
    assert late.ttft_s == pytest.approx(0.0) and late.queue_s == pytest.approx(0.0)
    assert result.summary.duration_s == pytest.approx(0.4)
    bad = result.records[3]
    assert not bad.ok and bad.error.startswith("invalid: prompt has 5000 tokens")
    assert result.summary.num_failed == 1 and result.summary.num_completed == 3


def test_compare_batching_static_wastes_slots():
    reqs = small_workload(12)
    cmp = compare_batching(reqs, tiny_args(), repeats=1, measure_costs=False,
                           progress=False, log=lambda *_: None)
    static, cont = cmp.runs["static"][0], cmp.runs["continuous"][0]
    assert static.summary.num_completed == cont.summary.num_completed == 12
    # Static holds each batch until its longest member ends: more, emptier steps.
    assert len(static.step_batch_sizes) > len(cont.step_batch_sizes)
    assert static.summary.extra["mean_batch_size"] < cont.summary.extra["mean_batch_size"]
    assert static.summary.extra["batching"] == "static"
    assert cmp.ideal.slot_ideal > 1.0
    # the paper replay is a lower bound (the engine may split a prefill over steps)
    assert len(static.step_batch_sizes) >= cmp.ideal.static_steps
    assert len(cont.step_batch_sizes) >= cmp.ideal.continuous_steps
    assert cmp.throughput_ratio > 0
    assert "slot ideal" in cmp.format()


def test_measure_step_costs_gives_a_time_per_batch_size():
    costs = measure_step_costs(tiny_args(), [2, 1], context_len=12, steps=2, warmup=1)
    assert costs.batch_sizes == [1, 2]
    assert all(t > 0 for t in costs.decode_s)
    assert costs.prefill_s_per_token >= 0


def test_cli_single_run_writes_json_records_and_plots(tmp_path, capsys):
    out = tmp_path / "run.json"
    argv = ["bench", "--model", "tiny", "--load-format", "dummy", "--num-threads",
            str(cpu_threads()), "--workload", os.path.join(DATA, "azure_sample.csv"),
            "--request-rate", "inf", "--input-scale", "0.05", "--output-scale", "0.1",
            "--slo-ttft", "60000", "--out", str(out), "--plot", str(tmp_path / "figs"),
            "--no-progress"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "output tokens/s" in text and "goodput" in text
    doc = json.loads(out.read_text())
    summary = doc["runs"][0]["summary"]
    assert summary["num_completed"] == 5
    assert summary["total_output_tokens"] == 4 + 11 + 6 + 2 + 30
    assert summary["goodput"] > 0
    assert doc["config"]["workload"].endswith("azure_sample.csv")
    lines = (tmp_path / "run.records.jsonl").read_text().splitlines()
    assert len(lines) == 5 and json.loads(lines[0])["run"] == "engine"
    assert (tmp_path / "figs" / "latency_cdf.png").stat().st_size > 1000
    # compare against itself: every ratio is 1
    assert main(["bench", "compare", str(out), str(out)]) == 0
    cmp = capsys.readouterr().out
    assert "output tokens/s" in cmp and "1.00x" in cmp


def test_cli_sweep_rate_plots_throughput_against_rate(tmp_path, capsys):
    argv = ["bench", "--model", "tiny", "--load-format", "dummy", "--num-threads",
            str(cpu_threads()), "--workload", "wide-output", "--num-requests", "4",
            "--input-scale", "0.02", "--output-scale", "0.01", "--sweep-rate", "50,inf",
            "--plot", str(tmp_path), "--out", str(tmp_path / "sweep.json"), "--no-progress"]
    assert main(argv) == 0
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["label"] for r in doc["runs"]] == ["rate=50", "rate=inf"]
    assert (tmp_path / "rate_sweep.png").exists()


def test_cli_errors_are_clear(tmp_path, capsys):
    assert main(["bench", "--workload", str(tmp_path / "none.csv"), "--no-progress"]) == 2
    assert "neither a file nor a preset" in capsys.readouterr().err
    assert main(["bench", "--backend", "openai"]) == 2
    assert "--base-url" in capsys.readouterr().err
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,5,x\n")
    assert main(["bench", "--workload", str(bad), "--model", "tiny",
                 "--load-format", "dummy"]) == 2
    assert "bad.csv:2: GeneratedTokens must be an integer" in capsys.readouterr().err


def test_bare_bench_is_the_main_job():
    parser = build_parser()
    assert _is_bare(parser.parse_args(["bench"]))
    assert not _is_bare(parser.parse_args(["bench", "--num-requests", "3"]))
    main_job = _standalone_parser().parse_args(MAIN_JOB_ARGV)
    assert main_job.compare_batching and main_job.model == "tiny"
    assert main_job.load_format == "dummy"


def test_step_trace_records_every_step_and_feeds_in_run_costs():
    from conveyor.bench.ideal import StepCosts

    result = run_engine(small_workload(8), tiny_args(), progress=False)
    trace = result.step_trace
    assert [b for b, _, _ in trace] == result.step_batch_sizes
    # every prompt token and every output token but the last is computed exactly once
    reqs = small_workload(8)
    assert sum(t for _, t, _ in trace) == sum(r.prompt_len + r.output_len - 1 for r in reqs)
    costs = StepCosts.from_step_trace(trace)
    decode_sizes = {b for b, t, _ in trace if t == b}
    assert costs is not None and set(costs.batch_sizes) == decode_sizes


def test_cli_compare_batching_prints_both_modes_and_saves(tmp_path, capsys):
    out = tmp_path / "cmp.json"
    argv = ["bench", "--model", "tiny", "--load-format", "dummy", "--num-threads",
            str(cpu_threads()), "--workload", "conversation", "--num-requests", "12",
            "--input-scale", "0.02", "--output-scale", "0.05", "--max-num-seqs", "4",
            "--compare-batching", "--no-measure-step-costs", "--out", str(out),
            "--plot", str(tmp_path), "--no-progress"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "continuous/static" in text and "slot ideal" in text
    doc = json.loads(out.read_text())
    assert [r["label"] for r in doc["runs"]] == ["static", "continuous"]
    assert doc["batching"]["slot_ideal"] > 1
    assert doc["batching"]["cost_ideal"] is None  # not measured
    assert len(doc["all_runs"]) == 2
    lines = (tmp_path / "cmp.records.jsonl").read_text().splitlines()
    assert sorted({json.loads(ln)["run"] for ln in lines}) == ["continuous", "static"]
    assert (tmp_path / "latency_cdf.png").exists()


def test_figures_name_the_plots_extra_when_matplotlib_is_missing(monkeypatch) -> None:
    import sys

    from conveyor.bench import plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    with pytest.raises(ImportError, match=r"pip install 'conveyor\[plots\]'"):
        plots.plot_latency_cdfs([], "unused.png")
