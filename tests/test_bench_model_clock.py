"""The modelled clock: cost model fitting and parsing, and engine replays in virtual time
whose timestamps are computed by hand."""

from __future__ import annotations

import json
import random

import pytest

from conveyor.bench.engine_backend import run_engine
from conveyor.bench.model_clock import ModelClock
from conveyor.bench.workload import BenchRequest
from conveyor.config import EngineArgs
from conveyor.costs.linear import LinearStepCost
from conveyor.costs.shape import BatchShape
from conveyor.engine.llm_engine import LLMEngine


def test_fit_recovers_a_noiseless_model():
    rng = random.Random(0)
    true = LinearStepCost(0.004, 2e-5, 3e-4)
    trace = []
    for _ in range(50):
        seqs, tokens = rng.randint(1, 16), rng.randint(1, 1024)
        trace.append((seqs, tokens, true.cost(seqs, tokens)))
    fitted = LinearStepCost.fit(trace)
    assert fitted.base_s == pytest.approx(true.base_s, rel=1e-6)
    assert fitted.per_token_s == pytest.approx(true.per_token_s, rel=1e-6)
    assert fitted.per_seq_s == pytest.approx(true.per_seq_s, rel=1e-6)


def test_fit_drops_a_negative_coefficient():
    # Steps get cheaper with more requests in this (made-up) trace: the per-request term
    # would be negative, so it is dropped and the others refitted without it.
    trace = [(1, 10, 0.010), (2, 10, 0.009), (4, 10, 0.008), (8, 20, 0.007)]
    fitted = LinearStepCost.fit(trace)
    assert fitted.per_seq_s == 0.0
    assert fitted.base_s >= 0 and fitted.per_token_s >= 0
    with pytest.raises(ValueError, match="at least 3 steps"):
        LinearStepCost.fit(trace[:2])


def test_parse_round_trips_and_rejects_bad_text():
    m = LinearStepCost(0.00337333, 3.20515e-05, 0.000475568)
    assert LinearStepCost.parse(m.describe()) == m
    with pytest.raises(ValueError, match="BASE,PER_TOKEN,PER_SEQ"):
        LinearStepCost.parse("0.1,0.2")
    with pytest.raises(ValueError, match="per_seq_s must be >= 0"):
        LinearStepCost.parse("0.1,0,-1")
    with pytest.raises(ValueError, match="charge something"):
        LinearStepCost(0.0, 0.0, 0.0)


def test_model_clock_moves_forward_only():
    clock = ModelClock()
    clock.add(1.5)
    clock.advance_to(1.0)
    assert clock() == 1.5
    clock.advance_to(4.0)
    assert clock() == 4.0


def tiny_engine() -> LLMEngine:
    return LLMEngine(EngineArgs(model="tiny", load_format="dummy", dtype="float32",
                                max_num_seqs=4, max_num_batched_tokens=256, num_threads=1,
                                attention_backend="sdpa"))


def test_virtual_replay_timestamps_by_hand():
    engine = tiny_engine()
    # Every step costs 1 s + 0.01 s per request. Request a: prompt 8, 3 tokens, at t=0:
    # steps end at 1.01, 2.02, 3.03. Request b arrives at 10 (the engine idles: the
    # clock jumps there) with 2 tokens: steps end at 11.01, 12.02.
    reqs = [BenchRequest("a", 0.0, list(range(16, 24)), 3),
            BenchRequest("b", 10.0, list(range(30, 35)), 2)]
    model = LinearStepCost(1.0, 0.0, 0.01)
    wall_clock, runner = engine.clock, engine.runner
    result = run_engine(reqs, engine=engine, progress=False, cost_model=model)
    a, b = result.records
    assert a.ttft_s == pytest.approx(1.01) and a.itls_s == pytest.approx([1.01, 1.01])
    assert a.e2e_s == pytest.approx(3.03)
    assert b.arrival_s == pytest.approx(10.0)
    assert b.ttft_s == pytest.approx(1.01) and b.e2e_s == pytest.approx(2.02)
    assert result.summary.duration_s == pytest.approx(12.02)
    assert [s for _, _, s in result.step_trace] == pytest.approx([1.01] * 5)
    # The engine gets its own clock and runner back.
    assert engine.clock is wall_clock and engine.runner is runner


def test_virtual_replay_is_deterministic_under_load():
    # A fresh engine per run: the second would otherwise find the prompts in its cache.
    reqs = [BenchRequest(str(i), 0.005 * i, list(range(16, 16 + 5 + 7 * (i % 5))),
                         1 + (3 * i) % 7) for i in range(12)]
    model = LinearStepCost(0.01, 1e-4, 1e-3)
    first = run_engine(reqs, engine=tiny_engine(), progress=False, cost_model=model)
    second = run_engine(reqs, engine=tiny_engine(), progress=False, cost_model=model)
    assert [(r.ttft_s, r.e2e_s, r.itls_s) for r in first.records] == \
        [(r.ttft_s, r.e2e_s, r.itls_s) for r in second.records]
    assert max(first.step_batch_sizes) == 4  # it was loaded: requests queued for slots


def test_cli_step_cost_replays_the_same_timeline_twice(tmp_path, capsys):
    from conveyor.entrypoints.cli import main

    argv = ["bench", "--model", "tiny", "--load-format", "dummy", "--num-threads", "1",
            "--attention-backend", "sdpa", "--workload", "conversation", "--num-requests", "6",
            "--input-scale", "0.02", "--output-scale", "0.05", "--max-num-seqs", "2",
            "--step-cost", "0.5,0,0", "--no-progress"]
    docs = []
    for i in range(2):
        out = tmp_path / f"run{i}.json"
        assert main([*argv, "--out", str(out)]) == 0
        assert "virtual time (step cost 0.5,0,0 s)" in capsys.readouterr().out
        docs.append(json.loads(out.read_text())["runs"][0]["summary"])
    assert docs[0]["latency"] == docs[1]["latency"]
    # Half a second a step: the run lasts exactly its number of steps times 0.5.
    assert docs[0]["duration_s"] == 0.5 * docs[0]["extra"]["num_steps"]
    assert main([*argv, "--backend", "openai", "--base-url", "http://x"]) == 2
    assert "--step-cost replays a plain engine-backend run" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv[:-3], "--step-cost", "1,2", "--no-progress"])
    assert "expected BASE,PER_TOKEN,PER_SEQ" in capsys.readouterr().err


class PrefillDecodeCost:
    """A simulator-style cost model: 0.1 s per prefill token, 1 s per decode row."""

    def step_time(self, shape) -> float:
        return 0.1 * shape.num_prefill_tokens + 1.0 * shape.num_decodes


def test_virtual_replay_takes_a_simulator_cost_model():
    # Prompt 8: its prefill step costs 0.8 s and gives the first token; two decode steps
    # of 1 s each give the other two.
    reqs = [BenchRequest("a", 0.0, list(range(16, 24)), 3)]
    result = run_engine(reqs, engine=tiny_engine(), progress=False,
                        cost_model=PrefillDecodeCost())
    (a,) = result.records
    assert a.ttft_s == pytest.approx(0.8) and a.itls_s == pytest.approx([1.0, 1.0])
    # The linear model speaks the same interface: 11 tokens in 4 rows.
    shape = BatchShape(num_prefill_tokens=8, num_prefills=1, num_decodes=3)
    assert LinearStepCost(1.0, 0.5, 0.25).step_time(shape) == pytest.approx(1 + 5.5 + 1)
