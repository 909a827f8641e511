"""The prefix-cache evaluation's library: ideals, workloads, family sampling, runs."""

from __future__ import annotations

import argparse
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.bench.engine_backend import run_engine
from conveyor.bench.metrics import RequestRecord, summarize
from conveyor.bench.prefix import hash_id_ideal, token_ideal
from conveyor.bench.prefix_study import CacheRun, fit_step_cost, proportionality, run_cache_mode
from conveyor.bench.prefix_workloads import ChatSessions, prefix_family_requests
from conveyor.bench.synthetic import parse_length_dist as dist
from conveyor.bench.traces import TraceRow, WorkloadError
from conveyor.bench.workload import (
    FIRST_PROMPT_TOKEN,
    BenchRequest,
    add_workload_args,
    sample_families,
    workload_rows,
)
from conveyor.config import EngineArgs

from helpers import cpu_threads, make_checkpoint

DATA = os.path.join(os.path.dirname(__file__), "data")


# ---- ideals -------------------------------------------------------------------------------
def test_token_ideal_counts_full_blocks_seen_before_and_leaves_one_token() -> None:
    p0 = list(range(100, 110))  # 10 tokens
    out0 = [7, 8, 9]  # 7 and 8 get KV; 9 is sampled last and never fed back
    seqs = [
        (p0, out0),  # cold; computes 12 tokens: 3 full blocks
        (p0[:8] + [50], []),  # 2 blocks of p0
        (p0 + out0 + [51, 52, 53], []),  # 3 blocks (the 3rd holds p0's tail and 7, 8)
        (p0[:3], [1]),  # shorter than a block
        (p0, [1]),  # all of p0 cached up to its last block: the last token is computed
    ]
    ideal = token_ideal(seqs, block_size=4)
    assert ideal.hit_tokens == [0, 8, 12, 0, 8]
    assert ideal.prompt_tokens == [10, 9, 16, 3, 10]
    # p0's 3 blocks (with 7, 8) and one more from the third request: [9, 51, 52, 53]
    assert ideal.working_set_blocks == 4
    assert ideal.hit_rate == pytest.approx(28 / 48)


def test_token_ideal_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="block_size"):
        token_ideal([([1], [])], 0)
    with pytest.raises(ValueError, match="empty prompt"):
        token_ideal([([], [1])], 4)


def test_hash_id_ideal_follows_prefix_chains() -> None:
    rows = [TraceRow(0.0, 1200, 1, (0, 1, 2)), TraceRow(1.0, 1100, 1, (0, 1, 3)),
            TraceRow(2.0, 300, 1, (4,)), TraceRow(3.0, 1000, 1, (0, 1, 2)),
            TraceRow(4.0, 900, 1, (5, 1))]  # id 1 again, but after another first block
    ideal = hash_id_ideal(rows)
    assert ideal.hit_tokens == [0, 1024, 0, 1000, 0]
    assert ideal.hit_rate == pytest.approx(2024 / 4500)


# ---- family sampling ----------------------------------------------------------------------
def rows_of(families: list[int]) -> list[TraceRow]:
    """Row i belongs to family families[i] (its first hash id)."""
    return [TraceRow(float(i), 64, 1, (f, 1000 + i)) for i, f in enumerate(families)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=40), st.integers(1, 40),
       st.integers(0, 3))
def test_family_samples_keep_whole_families(families, num, seed) -> None:
    rows = rows_of(families)
    sample = sample_families(rows, num, seed)
    assert sample == sample_families(rows, num, seed)
    assert len(sample) <= num
    picked = {r.hash_ids[0] for r in sample}
    assert len(sample) == sum(1 for f in families if f in picked), "a family was split"
    assert [r.arrival_s for r in sample] == sorted(r.arrival_s for r in sample)
    if num >= len(rows):
        assert len(sample) == len(rows)


def test_family_sampling_fills_up_with_small_families_and_needs_hash_ids() -> None:
    rows = rows_of([0, 0, 0, 0, 1, 2, 3, 4, 5])
    assert len(sample_families(rows, 3, seed=0)) == 3  # singletons fill what 4 cannot
    with pytest.raises(WorkloadError, match="hash_ids"):
        sample_families([TraceRow(0.0, 5, 1)], 1, 0)


def test_sample_families_from_the_command_line() -> None:
    path = os.path.join(DATA, "mooncake_sample.jsonl")  # families: id 0 (3 rows), id 4
    parser = add_workload_args(argparse.ArgumentParser())
    picks = set()
    for seed in range(8):
        args = parser.parse_args(["--workload", path, "--sample", "families",
                                  "--num-requests", "3", "--seed", str(seed)])
        rows = workload_rows(args)
        families = tuple(sorted({r.hash_ids[0] for r in rows}))
        assert rows[0].arrival_s == 0.0
        assert len(rows) == {(0,): 3, (4,): 1}[families], "whole families, at most 3 rows"
        picks.add(families)
    assert picks == {(0,), (4,)}, "the seed picks the family order"


# ---- workloads ----------------------------------------------------------------------------
def test_prefix_families_interleave_and_share_exactly_their_prefix() -> None:
    reqs = prefix_family_requests(9, 3, 20, dist("uniform:1-5"), dist("fixed:4"), 300,
                                  seed=1)
    assert reqs == prefix_family_requests(9, 3, 20, dist("uniform:1-5"), dist("fixed:4"),
                                          300, seed=1)
    assert [r.request_id.split("-")[0] for r in reqs] == ["f0", "f1", "f2"] * 3
    assert all(r.arrival_s == 0.0 and r.output_len == 4 for r in reqs)
    assert all(FIRST_PROMPT_TOKEN <= t < 300 for r in reqs for t in r.prompt_token_ids)
    heads = [r.prompt_token_ids[:20] for r in reqs]
    assert heads[0] == heads[3] == heads[6] and heads[0] != heads[1] != heads[2]
    assert reqs[0].prompt_token_ids[20:] != reqs[3].prompt_token_ids[20:]


def test_chat_turns_quote_the_conversation_so_far() -> None:
    chat = ChatSessions(2, 3, dist("fixed:6"), dist("fixed:2"), dist("fixed:3"), 300,
                        think_s=0.5)
    first = chat.first_turns()
    assert [r.request_id for r in first] == ["s0-t0", "s1-t0"]
    assert all(r.prompt_len == 6 and r.output_len == 3 for r in first)
    nxt = chat.follow_up(first[0], [40, 41, 42], 2.0)
    assert nxt.request_id == "s0-t1" and nxt.arrival_s == 2.5
    assert nxt.prompt_token_ids[:9] == first[0].prompt_token_ids + [40, 41, 42]
    assert nxt.prompt_len == 11
    last = chat.follow_up(nxt, [1, 2, 3], 3.0)
    assert last.request_id == "s0-t2" and last.prompt_token_ids[:14] == \
        nxt.prompt_token_ids + [1, 2, 3]
    assert chat.follow_up(last, [4, 5, 6], 4.0) is None
    assert chat.outputs == {"s0-t0": [40, 41, 42], "s0-t1": [1, 2, 3], "s0-t2": [4, 5, 6]}
    with pytest.raises(WorkloadError, match="num_turns"):
        ChatSessions(1, 0, dist("fixed:6"), dist("fixed:2"), dist("fixed:3"), 300)


def test_follow_ups_with_a_taken_id_are_refused() -> None:
    args = EngineArgs(model="tiny", load_format="dummy", num_kv_blocks=64, max_num_seqs=2,
                      num_threads=cpu_threads())
    reqs = [BenchRequest("a", 0.0, [20, 21, 22], 2)]
    with pytest.raises(ValueError, match="already in use"):
        run_engine(reqs, args, progress=False,
                   follow_up=lambda req, out, t: BenchRequest("a", t, [20], 1))


# ---- runs ---------------------------------------------------------------------------------
def test_chat_run_hits_exactly_the_ideal_and_matches_the_uncached_run() -> None:
    """Closed loop through the engine: every turn finds the whole conversation before it
    (the answer's blocks included), the same tokens come out with caching off, and the
    prefill counted from the scheduler is what the hits left over."""
    path = make_checkpoint("llama")
    args = EngineArgs(model=path, dtype="float32", block_size=4, num_kv_blocks=256,
                      max_num_seqs=2, max_num_batched_tokens=64, num_threads=cpu_threads())

    def make():
        chat = ChatSessions(3, 3, dist("uniform:5-11"), dist("uniform:1-6"),
                            dist("uniform:2-5"), 384, seed=3)
        return chat.first_turns(), chat.follow_up

    on = run_cache_mode(make, args, caching=True)
    off = run_cache_mode(make, args, caching=False)
    assert on.summary.num_completed == off.summary.num_completed == 9
    assert on.by_id() == off.by_id() and len(on.request_ids) == 9
    ideal = token_ideal(on.sequences, 4)
    assert on.hits == ideal.hits > 0 and on.queries == ideal.queries == on.prompt_tokens
    assert on.prefill_tokens == on.prompt_tokens - on.hits
    assert off.hits == 0 and off.prefill_tokens == off.prompt_tokens
    assert ideal.working_set_blocks <= on.num_kv_blocks and on.num_evictions == 0
    p = proportionality(off, on)
    assert p.prefill_saved == pytest.approx(on.hits / on.prompt_tokens)
    assert p.saved_tokens_per_request == pytest.approx(on.hits / 9)


def fake_run(label: str, ttfts: list[float], prefill: int,
             trace: list[tuple[int, int, float]]) -> CacheRun:
    records = [RequestRecord(str(i), 0.0, "default", 0, 10, 2, 2, ttft_s=t,
                             finish_reason="length") for i, t in enumerate(ttfts)]
    return CacheRun(label, summarize(records, 1.0), 40, 0, prefill, 40, 0, 0, 64,
                    step_trace=trace)


def test_proportionality_compares_ttft_saved_with_the_fitted_token_cost() -> None:
    # Steps cost 2 ms + 0.1 ms per token; 4 requests save 30 tokens each: 3 ms expected.
    trace = [(1, n, 0.002 + 0.0001 * n) for n in (1, 10, 40, 100)]
    assert fit_step_cost(trace) == pytest.approx((0.002, 0.0001))
    assert fit_step_cost([(1, 5, 0.1), (2, 5, 0.2), (3, 5, 0.3)]) is None
    off = fake_run("off", [0.010, 0.012, 0.014, 0.016], 160, trace)
    on = fake_run("on", [0.007, 0.009, 0.011, 0.013], 40, trace)
    p = proportionality(off, on)
    assert p.prefill_saved == pytest.approx(0.75)
    assert p.expected_ms == pytest.approx(3.0)
    assert p.ttft_saved_ms["mean"] == pytest.approx(3.0)
    assert p.ratio() == pytest.approx(1.0)
    assert p.ttft_saved["mean"] == pytest.approx(3 / 13)
