"""Workloads: trace parsers, bad rows, arrival rescaling, Mooncake prefixes, synthetic specs."""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.bench.synthetic import arrival_times, parse_length_dist, synthetic_rows
from conveyor.bench.traces import (
    TraceRow,
    WorkloadError,
    parse_azure_csv,
    parse_mooncake_jsonl,
    parse_trace,
)
from conveyor.bench.workload import (
    FIRST_PROMPT_TOKEN,
    PromptFactory,
    add_workload_args,
    build_requests,
    load_workload,
    rescale_to_rate,
    scale_lengths,
    select_rows,
)

DATA = os.path.join(os.path.dirname(__file__), "data")
AZURE = os.path.join(DATA, "azure_sample.csv")
MOONCAKE = os.path.join(DATA, "mooncake_sample.jsonl")
REAL_TRACES = "/work/shared/traces"


def workload_args(*argv: str) -> argparse.Namespace:
    return add_workload_args(argparse.ArgumentParser()).parse_args(list(argv))


def read_lines(path: str) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---- Azure CSV ----------------------------------------------------------------------------
def test_azure_fixture_parses_to_relative_arrivals():
    rows = parse_azure_csv(AZURE)
    assert [r.input_len for r in rows] == [374, 396, 879, 91, 1200]
    assert [r.output_len for r in rows] == [44, 109, 55, 16, 300]
    expected = [0.0, 4.314579, 4.541877, 4.710427, 10.0]
    assert [r.arrival_s for r in rows] == pytest.approx(expected, abs=1e-6)
    assert parse_trace(AZURE) == rows  # format told by the .csv extension


def test_azure_accepts_numeric_timestamps_and_reordered_columns(tmp_path):
    path = write(tmp_path, "t.csv", "GeneratedTokens,ContextTokens,TIMESTAMP\n"
                                    "5,10,100.5\n7,20,100.0\n")
    rows = parse_azure_csv(path)
    # sorted by arrival: the second line came first
    assert [(r.arrival_s, r.input_len, r.output_len) for r in rows] == [(0.0, 20, 7),
                                                                       (0.5, 10, 5)]


@pytest.mark.parametrize("bad_line, message", [
    ("2023-11-16 18:15:52.0,abc,10", "ContextTokens must be an integer, got 'abc'"),
    ("2023-11-16 18:15:52.0,10,0", "GeneratedTokens must be >= 1, got 0"),
    ("not-a-time,10,10", "TIMESTAMP 'not-a-time'"),
    ("2023-11-16 18:15:52.0,10", "expected 3 fields, got 2"),
])
def test_azure_bad_row_names_the_line(tmp_path, bad_line, message):
    lines = read_lines(AZURE)
    lines.insert(3, bad_line)  # becomes line 4 of the file
    path = write(tmp_path, "bad.csv", "\n".join(lines) + "\n")
    with pytest.raises(WorkloadError) as err:
        parse_azure_csv(path)
    assert f"bad.csv:4: {message}" in str(err.value)


def test_azure_header_and_empty_file_errors(tmp_path):
    with pytest.raises(WorkloadError, match=r"lacks column.*GeneratedTokens"):
        parse_azure_csv(write(tmp_path, "h.csv", "TIMESTAMP,ContextTokens\n1,2\n"))
    with pytest.raises(WorkloadError, match="no requests"):
        parse_azure_csv(write(tmp_path, "e.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"))
    with pytest.raises(WorkloadError, match="cannot tell the trace format"):
        parse_trace(write(tmp_path, "x.txt", "whatever"))


# ---- Mooncake JSONL -----------------------------------------------------------------------
def test_mooncake_fixture_parses_ms_to_seconds():
    rows = parse_mooncake_jsonl(MOONCAKE)
    assert [r.arrival_s for r in rows] == [0.0, 0.25, 1.5, 3.0]
    assert [r.hash_ids for r in rows] == [(0, 1, 2), (0, 1, 3), (4,), (0, 5)]
    assert [r.input_len for r in rows] == [1200, 1100, 300, 700]
    assert parse_trace(MOONCAKE) == rows


def test_mooncake_row_without_hash_ids_is_a_private_prompt_of_any_length(tmp_path):
    path = write(tmp_path, "plain.jsonl",
                 '{"timestamp": 0, "input_length": 5000, "output_length": 2}\n'
                 '{"timestamp": 12.5, "input_length": 40, "output_length": 3}\n')
    rows = parse_mooncake_jsonl(path)
    assert [(r.arrival_s, r.input_len, r.hash_ids) for r in rows] == [
        (0.0, 5000, ()), (0.0125, 40, ())]


@pytest.mark.parametrize("bad_line, message", [
    ('{"timestamp": 5, "input_length": 10', "not valid JSON"),
    ('{"timestamp": 5, "output_length": 3, "hash_ids": [1]}', "missing field 'input_length'"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 3}', "timestamp must be"),
    ('{"timestamp": 5, "input_length": 10, "output_length": 0}', "output_length must be"),
    ('{"timestamp": 5, "input_length": 10, "output_length": 2, "hash_ids": ["a"]}',
     "hash_ids must be"),
    ('{"timestamp": 5, "input_length": 5000, "output_length": 2, "hash_ids": [1]}',
     "1 hash_ids cover 512 tokens"),
    ('[1, 2]', "expected a JSON object"),
])
def test_mooncake_bad_row_names_the_line(tmp_path, bad_line, message):
    lines = read_lines(MOONCAKE)
    lines.insert(2, bad_line)  # line 3
    path = write(tmp_path, "bad.jsonl", "\n".join(lines) + "\n")
    with pytest.raises(WorkloadError) as err:
        parse_mooncake_jsonl(path)
    assert "bad.jsonl:3: " in str(err.value)
    assert message in str(err.value)


def test_mooncake_prefix_expansion_shares_exactly_the_common_blocks():
    rows = parse_mooncake_jsonl(MOONCAKE)
    reqs = build_requests(rows, vocab_size=1000, seed=7)
    a, b, c, d = (r.prompt_token_ids for r in reqs)
    assert [len(p) for p in (a, b, c, d)] == [1200, 1100, 300, 700]
    assert a[:1024] == b[:1024]  # ids 0, 1 shared
    assert a[1024:1100] != b[1024:1100]  # id 2 vs id 3
    assert d[:512] == a[:512]  # id 0 again, in a later request
    assert d[512:] != a[512:700]
    assert c[:300] != a[:300]
    # Same id, same tokens, whoever asks and in which order.
    fresh = PromptFactory(1000, seed=7)
    assert fresh.block(1, 512).tolist() == a[512:1024]
    assert PromptFactory(1000, seed=8).block(1, 512).tolist() != a[512:1024]
    assert all(FIRST_PROMPT_TOKEN <= t < 1000 for p in (a, b, c, d) for t in p)


def test_mooncake_short_hash_list_is_padded_with_request_own_tokens():
    row = TraceRow(0.0, 700, 3, hash_ids=(9,))  # 512 from the block, 188 padding
    other = TraceRow(0.0, 700, 3, hash_ids=(9,))
    a, b = build_requests([row, other], vocab_size=500, seed=1)
    assert len(a.prompt_token_ids) == 700
    assert a.prompt_token_ids[:512] == b.prompt_token_ids[:512]
    assert a.prompt_token_ids[512:] != b.prompt_token_ids[512:]


def test_mooncake_input_scale_keeps_prefix_sharing():
    rows = scale_lengths(parse_mooncake_jsonl(MOONCAKE), 0.1, 1.0, None, None)
    assert [r.input_len for r in rows] == [120, 110, 30, 70]
    assert rows[0].block_tokens == 51
    a, b, *_ = build_requests(rows, vocab_size=1000, seed=0)
    assert a.prompt_token_ids[:102] == b.prompt_token_ids[:102]
    assert a.prompt_token_ids[102:110] != b.prompt_token_ids[102:110]


# ---- arrivals and lengths -----------------------------------------------------------------
def rows_at(*times: float) -> list[TraceRow]:
    return [TraceRow(t, 10, 5) for t in times]


def test_rescale_to_rate_hand_computed():
    out = rescale_to_rate(rows_at(0.0, 1.0, 3.0), 2.0)
    # mean gap 1.5 s -> 0.5 s: everything scales by 1/3
    assert [r.arrival_s for r in out] == pytest.approx([0.0, 1 / 3, 1.0])
    assert [r.arrival_s for r in rescale_to_rate(rows_at(0.0, 1.0, 3.0), math.inf)] == \
        [0.0, 0.0, 0.0]
    with pytest.raises(WorkloadError, match="request-rate"):
        rescale_to_rate(rows_at(0.0, 1.0), 0.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1e4), min_size=2, max_size=40), st.floats(0.01, 1e3))
def test_rescale_to_rate_property(times, rate):
    rows = rows_at(*sorted(times))
    out = rescale_to_rate(rows, rate)
    arrivals = [r.arrival_s for r in out]
    assert arrivals == sorted(arrivals)
    span = rows[-1].arrival_s - rows[0].arrival_s
    if span > 1e-6:
        assert arrivals[0] == 0.0
        assert (len(rows) - 1) / arrivals[-1] == pytest.approx(rate, rel=1e-6)


def test_select_rows_head_and_random():
    rows = rows_at(*[float(i) for i in range(10)])
    head = select_rows(rows, 3, "head", 0)
    assert [r.arrival_s for r in head] == [0.0, 1.0, 2.0]
    sample = select_rows(rows, 4, "random", 5)
    assert sample == select_rows(rows, 4, "random", 5)  # seeded
    assert sample[0].arrival_s == 0.0  # re-based to the first sampled arrival
    assert [r.arrival_s for r in sample] == sorted(r.arrival_s for r in sample)
    assert len({r.arrival_s for r in sample}) == 4


def test_scale_lengths_rounds_floors_at_one_and_caps():
    rows = [TraceRow(0.0, 1000, 3), TraceRow(0.0, 3, 400)]
    out = scale_lengths(rows, 0.25, 0.1, 200, None)
    assert [(r.input_len, r.output_len) for r in out] == [(200, 1), (1, 40)]
    out = scale_lengths(rows, 1.0, 1.0, None, 100)
    assert [r.output_len for r in out] == [3, 100]


def test_load_workload_trace_options():
    args = workload_args("--workload", AZURE, "--num-requests", "3", "--request-rate", "1",
                         "--input-scale", "0.5", "--output-scale", "0.1",
                         "--max-input-len", "300", "--slo-ttft", "200")
    reqs = load_workload(args, vocab_size=100)
    assert [r.prompt_len for r in reqs] == [187, 198, 300]
    assert [r.output_len for r in reqs] == [4, 11, 6]
    # 3 requests at 1 req/s: the span is 2 s, the shape kept
    assert reqs[-1].arrival_s == pytest.approx(2.0)
    assert reqs[1].arrival_s == pytest.approx(2 * 4.314579 / 4.541877)
    assert all(r.slo_ttft_ms == 200 and r.slo_tpot_ms is None for r in reqs)
    assert all(FIRST_PROMPT_TOKEN <= t < 100 for r in reqs for t in r.prompt_token_ids)
    # distinct prompts: no accidental shared prefix between requests
    assert reqs[0].prompt_token_ids[:16] != reqs[1].prompt_token_ids[:16]


def test_load_workload_time_scale_and_errors(tmp_path):
    reqs = load_workload(workload_args("--workload", MOONCAKE, "--time-scale", "0.5"), 1000)
    assert [r.arrival_s for r in reqs] == [0.0, 0.125, 0.75, 1.5]
    with pytest.raises(WorkloadError, match="neither a file nor a preset"):
        load_workload(workload_args("--workload", str(tmp_path / "nope.csv")), 1000)
    with pytest.raises(WorkloadError, match="--input-scale must be > 0"):
        load_workload(workload_args("--workload", AZURE, "--input-scale", "0"), 1000)
    with pytest.raises(WorkloadError, match="apply to presets"):
        load_workload(workload_args("--workload", AZURE, "--input-len", "fixed:3"), 1000)


def test_preset_workload_is_seeded_and_labelled_by_mix():
    argv = ["--workload", "conversation", "--num-requests", "2000",
            "--tenants", "a=3,b=1", "--priorities", "0=0.5,2=0.5", "--seed", "3"]
    reqs = load_workload(workload_args(*argv), vocab_size=5000)
    again = load_workload(workload_args(*argv), vocab_size=5000)
    assert [r.prompt_token_ids for r in reqs[:5]] == [r.prompt_token_ids for r in again[:5]]
    assert [r.tenant for r in reqs] == [r.tenant for r in again]
    other = load_workload(workload_args(*argv[:-1], "4"), vocab_size=5000)
    assert [r.output_len for r in other] != [r.output_len for r in reqs]
    share_a = sum(r.tenant == "a" for r in reqs) / len(reqs)
    assert 0.70 < share_a < 0.80
    assert {r.priority for r in reqs} == {0, 2}
    assert all(r.arrival_s == 0.0 for r in reqs)  # preset default: all at t=0
    # conversation lengths: medians near the Azure trace's
    assert 900 < statistics.median(r.prompt_len for r in reqs) < 1150
    assert 110 < statistics.median(r.output_len for r in reqs) < 150
    assert max(r.output_len for r in reqs) <= 1000


def test_preset_overrides_and_mix_errors():
    reqs = load_workload(workload_args("--workload", "wide-output", "--num-requests", "50",
                                       "--input-len", "fixed:7", "--output-len",
                                       "uniform:2-4"), 100)
    assert {r.prompt_len for r in reqs} == {7}
    assert {r.output_len for r in reqs} <= {2, 3, 4}
    with pytest.raises(SystemExit):
        workload_args("--tenants", "a=-1")
    with pytest.raises(SystemExit):
        workload_args("--priorities", "high=1")


# ---- synthetic ----------------------------------------------------------------------------
def test_parse_length_dist():
    assert parse_length_dist("fixed:12").describe() == "fixed:12"
    assert parse_length_dist("uniform:3-9").describe() == "uniform:3-9"
    d = parse_length_dist("lognormal:median=100,sigma=0.5,max=300")
    assert (d.median, d.sigma, d.lo, d.hi) == (100, 0.5, 1, 300)
    for bad in ("gauss:3", "uniform:9-3", "fixed:x", "lognormal:sigma=1", "uniform:0-4",
                "lognormal:median=5,sigma=1,foo=2"):
        with pytest.raises(WorkloadError):
            parse_length_dist(bad)


def test_poisson_and_gamma_arrivals():
    import random

    def gaps(ts: list[float]) -> list[float]:
        return [b - a for a, b in itertools.pairwise(ts)]

    poisson = gaps(arrival_times(4001, 4.0, 1.0, random.Random(0)))
    assert statistics.fmean(poisson) == pytest.approx(0.25, rel=0.05)
    cv_poisson = statistics.pstdev(poisson) / statistics.fmean(poisson)
    assert cv_poisson == pytest.approx(1.0, abs=0.08)
    bursty = gaps(arrival_times(4001, 4.0, 0.25, random.Random(0)))
    assert statistics.fmean(bursty) == pytest.approx(0.25, rel=0.1)
    # gamma with shape k has CV 1/sqrt(k): 2 for k = 0.25
    assert statistics.pstdev(bursty) / statistics.fmean(bursty) == pytest.approx(2.0, rel=0.15)
    assert arrival_times(3, math.inf, 1.0, random.Random(0)) == [0.0, 0.0, 0.0]
    with pytest.raises(WorkloadError, match="burstiness"):
        arrival_times(3, 1.0, 0.0, random.Random(0))


def test_synthetic_rows_rate():
    from conveyor.bench.synthetic import PRESETS

    rows = synthetic_rows(PRESETS["wide-output"], 500, 10.0, 1.0, seed=1)
    assert rows[0].arrival_s == 0.0
    assert 499 / rows[-1].arrival_s == pytest.approx(10.0, rel=0.12)
    assert all(16 <= r.output_len <= 1024 and 128 <= r.input_len <= 1024 for r in rows)


# ---- the real traces (skipped when the shared folder is absent) ---------------------------
@pytest.mark.skipif(not os.path.isdir(REAL_TRACES), reason="shared traces not present")
def test_real_traces_parse():
    azure = parse_trace(os.path.join(REAL_TRACES, "azure_conv_2023.csv"))
    assert len(azure) == 19366
    assert 3400 < azure[-1].arrival_s < 3700  # one hour
    moon = parse_trace(os.path.join(REAL_TRACES, "mooncake_synthetic.jsonl"))
    assert len(moon) == 3993
    reqs = build_requests(scale_lengths(moon[:20], 0.01, 1.0, None, None), 1000)
    assert [r.prompt_len for r in reqs] == [max(1, round(r.input_len * 0.01))
                                            for r in moon[:20]]
