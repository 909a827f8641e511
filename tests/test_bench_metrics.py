"""Percentiles, records, goodput, report files and the static/continuous ideals, by hand."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.bench.ideal import (
    StepCosts,
    continuous_schedule,
    ideal_ratios,
    static_schedule,
)
from conveyor.bench.metrics import (
    RequestRecord,
    RunResult,
    percentile,
    records_from_metrics,
    summarize,
)
from conveyor.bench.report import compare_files, format_comparison, load_summaries, save_json
from conveyor.bench.workload import BenchRequest
from conveyor.outputs import RequestMetrics


def bench_request(rid: str = "0", output_len: int = 3, prompt_len: int = 4,
                  **kw) -> BenchRequest:
    return BenchRequest(rid, 0.0, list(range(16, 16 + prompt_len)), output_len, **kw)


def metrics_with(arrival: float, scheduled: float, token_times: list[float],
                 prompt: int = 4, preemptions: int = 0) -> RequestMetrics:
    return RequestMetrics(arrival_time=arrival, first_scheduled_time=scheduled,
                          first_token_time=token_times[0], last_token_time=token_times[-1],
                          finished_time=token_times[-1], num_prompt_tokens=prompt,
                          num_generation_tokens=len(token_times), num_preemptions=preemptions,
                          finish_reason="length", token_times=list(token_times))


# ---- percentiles --------------------------------------------------------------------------
def test_percentile_hand_computed():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 90) == pytest.approx(3.7)  # 1 + 0.9 * 3 = position 2.7
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy(xs, q):
    import numpy as np

    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-9,
                                              abs=1e-6)


# ---- records ------------------------------------------------------------------------------
def test_record_from_metrics_hand_computed():
    m = metrics_with(arrival=10.0, scheduled=10.5, token_times=[11.0, 11.5, 12.5],
                     preemptions=1)
    rec = RequestRecord.from_metrics(bench_request(tenant="t", priority=2), m, t0=9.0)
    assert rec.arrival_s == 1.0
    assert rec.ttft_s == 1.0
    assert rec.queue_s == 0.5
    assert rec.tpot_s == pytest.approx(0.75)  # (12.5 - 11) / (3 - 1)
    assert rec.itls_s == [0.5, 1.0]
    assert rec.e2e_s == 2.5
    assert (rec.output_tokens, rec.prompt_tokens, rec.expected_output_tokens) == (3, 4, 3)
    assert (rec.tenant, rec.priority, rec.num_preemptions) == ("t", 2, 1)
    assert rec.ok


def test_summary_and_goodput_hand_computed():
    # SLO: TTFT <= 600 ms, TPOT <= 100 ms.
    slo = dict(slo_ttft_ms=600.0, slo_tpot_ms=100.0)
    reqs = [bench_request(str(i), **slo) for i in range(4)]
    recs = [
        # meets both: TTFT 0.5 s, TPOT 0.1 s
        RequestRecord.from_metrics(reqs[0], metrics_with(0.0, 0.1, [0.5, 0.6, 0.7]), 0.0),
        # misses TPOT: (1.5 - 0.5) / 2 = 0.5 s
        RequestRecord.from_metrics(reqs[1], metrics_with(0.0, 0.0, [0.5, 1.0, 1.5]), 0.0),
        # one token: TPOT undefined, met trivially; TTFT 0.2 s
        RequestRecord.from_metrics(reqs[2], metrics_with(1.0, 1.1, [1.2]), 0.0),
        RequestRecord.failed(reqs[3], "invalid: prompt too long"),
    ]
    s = summarize(recs, duration_s=2.0)
    assert (s.num_requests, s.num_completed, s.num_failed) == (4, 3, 1)
    assert s.goodput == pytest.approx(2 / 2.0)
    assert s.slo_attainment == pytest.approx(2 / 4)
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx(7 / 2.0)
    assert s.input_throughput == pytest.approx(12 / 2.0)
    assert s.latency["ttft"].mean == pytest.approx((500 + 500 + 200) / 3)
    assert s.latency["ttft"].median == pytest.approx(500)
    # ITLs pooled over requests: 100, 100, 500, 500 ms
    assert s.latency["itl"].median == pytest.approx(300)
    assert s.latency["itl"].p90 == pytest.approx(500)
    assert s.latency["tpot"].count == 2
    assert s.latency["queue"].mean == pytest.approx((100 + 0 + 100) / 3)
    assert s.num_preemptions == 0


def test_goodput_absent_without_slo_and_ttft_slo_alone():
    recs = [RequestRecord.from_metrics(bench_request(), metrics_with(0, 0, [0.3, 0.4]), 0)]
    assert summarize(recs, 1.0).goodput is None
    rec = RequestRecord.from_metrics(bench_request(slo_ttft_ms=250.0),
                                     metrics_with(0, 0, [0.3, 9.0]), 0)
    assert not rec.meets_slo  # TTFT 300 ms > 250 ms; no TPOT target
    rec = RequestRecord.from_metrics(bench_request(slo_ttft_ms=300.0),
                                     metrics_with(0, 0, [0.3, 9.0]), 0)
    assert rec.meets_slo
    aborted = RequestRecord.from_metrics(bench_request(slo_ttft_ms=1e9),
                                         metrics_with(0, 0, [0.1]), 0)
    aborted.finish_reason = "abort"
    assert not aborted.ok and not aborted.meets_slo


# ---- report files -------------------------------------------------------------------------
def _run(label: str, throughput_scale: float) -> RunResult:
    recs = [RequestRecord.from_metrics(bench_request(str(i)),
                                       metrics_with(0, 0, [0.1, 0.2, 0.3]), 0)
            for i in range(4)]
    return RunResult(label, recs, summarize(recs, duration_s=1.0 / throughput_scale))


def test_json_round_trip_and_compare(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    save_json(str(a), [_run("continuous", 1.0)], {"rate": math.inf})
    save_json(str(b), [_run("continuous", 2.0)], {"rate": 4.0})
    doc = json.loads(a.read_text())  # strict JSON: no NaN, inf as a string
    assert doc["config"]["rate"] == "inf"
    loaded = load_summaries(str(a))["continuous"]
    assert loaded.output_throughput == pytest.approx(12.0)
    text = compare_files(str(a), str(b))
    line = next(ln for ln in text.splitlines() if ln.startswith("output tokens/s"))
    assert line.split()[-1] == "2.00x"
    assert "B/A" in text
    with pytest.raises(ValueError, match="not a conveyor bench result"):
        load_summaries(str(tmp_path / "missing.json"))


def test_format_comparison_has_ratio_column():
    text = format_comparison({"static": _run("s", 1.0).summary,
                              "continuous": _run("c", 3.0).summary})
    header = text.splitlines()[0].split()
    assert header[-1] == "continuous/static"
    row = next(ln for ln in text.splitlines() if ln.startswith("requests/s"))
    assert row.split()[-1] == "3.00x"


# ---- ideals -------------------------------------------------------------------------------
def test_schedules_hand_computed():
    lens = [4, 1, 1, 4]
    # static, 2 slots: [4, 1] runs 4 steps, then [1, 4] runs 4 steps
    assert static_schedule(lens, 2) == [2, 1, 1, 1, 2, 1, 1, 1]
    # continuous: the 1-token requests' slots are refilled at once
    assert continuous_schedule(lens, 2) == [2, 2, 2, 2, 1, 1]
    reqs = [bench_request(str(i), output_len=n, prompt_len=10) for i, n in enumerate(lens)]
    costs = StepCosts([1, 2], [1.0, 1.5], prefill_s_per_token=0.05)
    ideal = ideal_ratios(reqs, 2, costs)
    assert (ideal.static_steps, ideal.continuous_steps, ideal.useful_tokens) == (8, 6, 10)
    assert ideal.slot_ideal == pytest.approx(8 / 6)
    assert ideal.packing_bound == pytest.approx(8 * 2 / 10)
    assert ideal.cost_ideal == pytest.approx(9.0 / 8.0)  # 2*(1.5+1+1+1) vs 4*1.5+2*1
    assert ideal.cost_ideal_with_prefill == pytest.approx((9.0 + 2.0) / (8.0 + 2.0))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=40), st.integers(1, 8))
def test_schedules_do_the_same_work(lens, slots):
    static, cont = static_schedule(lens, slots), continuous_schedule(lens, slots)
    assert sum(static) == sum(cont) == sum(lens)  # every token computed once
    assert max(static) <= slots and max(cont) <= slots
    assert len(cont) <= len(static)  # refilling slots never takes more steps
    assert len(cont) >= math.ceil(sum(lens) / slots)


def test_step_costs_interpolate():
    costs = StepCosts([1, 2, 4], [1.0, 2.0, 2.5])
    assert costs.decode(1) == 1.0
    assert costs.decode(3) == pytest.approx(2.25)
    assert costs.decode(8) == pytest.approx(3.5)  # extrapolated from the last segment
    assert StepCosts([4], [7.0]).decode(2) == 7.0


def test_records_from_metrics_keeps_workload_order_and_flags_missing():
    reqs = [bench_request("a"), bench_request("b"), bench_request("c")]
    metrics = {"c": metrics_with(5.0, 5.0, [5.5, 6.0]), "a": metrics_with(1.0, 1.0, [2.0])}
    recs = records_from_metrics(reqs, metrics, t0=1.0)
    assert [r.request_id for r in recs] == ["a", "b", "c"]
    assert recs[0].ttft_s == 1.0 and recs[2].arrival_s == 4.0
    assert not recs[1].ok and recs[1].error == "no result"
