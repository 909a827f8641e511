"""The simulated engine: timing, metrics and refusals on cases small enough to count by hand."""

from __future__ import annotations

import re

import pytest
from sim_helpers import LinearCost, make_workload, tiny_args

from conveyor.bench.workload import BenchRequest
from conveyor.sim import Simulator

COST = LinearCost(per_step=0.01, per_token=0.001)  # seconds per step, per token


def run(work, **overrides):
    kw = dict(num_kv_blocks=64, max_num_batched_tokens=16)
    kw.update(overrides)
    return Simulator(tiny_args(**kw), COST).run(work)


def test_a_lone_request_by_hand():
    # 40 prompt tokens in chunks of 16, 16, 8 (the last samples the first token), then
    # one decode step per token: 0.026 + 0.026 + 0.018 = 0.070 s to the first token,
    # 0.011 s per token after it. The engine idles until the arrival at t=1.
    res = run([BenchRequest("a", 1.0, list(range(10, 50)), 5)])
    m = res.finished["a"]
    assert m.first_scheduled_time == 1.0
    assert m.ttft == pytest.approx(0.070)
    assert m.token_times == pytest.approx([1.070, 1.081, 1.092, 1.103, 1.114])
    assert m.finished_time == m.last_token_time == m.token_times[-1]
    assert m.tpot == pytest.approx(0.011)
    assert (m.num_prompt_tokens, m.num_generation_tokens, m.finish_reason) == (40, 5, "length")
    assert res.num_steps == 3 + 4 and res.num_events == 1 + 7
    assert res.sim_time == pytest.approx(1.114)


def test_an_arrival_at_a_step_end_joins_the_next_step():
    # a's first step (10 tokens) ends at 0.02; b arriving exactly then is scheduled then,
    # c arriving just after waits for the following step (ending at 0.02 + 0.013).
    work = [BenchRequest("a", 0.0, list(range(10, 20)), 3),
            BenchRequest("b", 0.02, list(range(30, 32)), 2),
            BenchRequest("c", 0.0200001, list(range(40, 42)), 2)]
    res = run(work)
    assert res.finished["b"].first_scheduled_time == pytest.approx(0.02)
    assert res.finished["c"].first_scheduled_time == pytest.approx(0.02 + 0.013)


def test_every_request_runs_to_its_output_length():
    work = make_workload(40, seed=5, output_range=(1, 40))
    res = run(work, max_num_batched_tokens=64, max_num_seqs=8)
    assert not res.errors and not res.unfinished
    for w in work:
        m = res.finished[w.request_id]
        assert m.num_generation_tokens == w.output_len
        assert len(m.token_times) == w.output_len
        assert m.arrival_time == w.arrival_s
        assert m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert (m.tenant, m.priority) == (w.tenant, w.priority)


def test_the_model_length_caps_the_output():
    # 4 blocks of 16 tokens: max_model_len 64; a 60-token prompt can only grow by 4.
    res = run([BenchRequest("a", 0.0, list(range(10, 70)), 10)], num_kv_blocks=4,
              max_num_batched_tokens=64)
    assert res.max_model_len == 64
    assert res.finished["a"].num_generation_tokens == 4


@pytest.mark.parametrize("prompt, message", [
    ([], "prompt is empty"),
    ([5, 99999], "outside \\[0, 2048\\)"),
    (list(range(10, 80)), "max_model_len is 64"),
])
def test_requests_the_engine_would_refuse_are_reported_not_run(prompt, message):
    work = [BenchRequest("bad", 0.0, prompt, 3), BenchRequest("ok", 0.0, [5, 6, 7], 3)]
    res = run(work, num_kv_blocks=4)
    assert set(res.errors) == {"bad"}
    assert res.errors["bad"].startswith("invalid: ")
    assert re.search(message, res.errors["bad"])
    assert set(res.finished) == {"ok"}


def test_a_full_queue_refuses_like_the_engine():
    work = [BenchRequest(f"r{i}", 0.0, list(range(10, 40)), 3) for i in range(5)]
    res = run(work, max_num_seqs=1, max_queue_len=2)
    # All arrive before the first step: two fit the queue, three are refused.
    assert len(res.finished) == 2
    assert all(e.startswith("rejected: the waiting queue is full")
               for e in res.errors.values())
    assert res.replicas[0].num_rejected == len(res.errors) == 3


def test_queue_wait_rejection_is_recorded_as_an_abort():
    work = [BenchRequest("long", 0.0, list(range(10, 40)), 30),
            BenchRequest("late", 0.001, list(range(50, 60)), 2)]
    res = run(work, max_num_seqs=1, max_queue_wait_s=0.05, queue_wait_action="reject")
    late = res.finished["late"]
    assert late.finish_reason == "abort" and late.num_generation_tokens == 0
    assert late.finished_time >= 0.05 + 0.001
    assert res.finished["long"].num_generation_tokens == 30


def test_duplicate_request_ids_are_an_error():
    work = [BenchRequest("x", 0.0, [5, 6], 2), BenchRequest("x", 1.0, [5, 6], 2)]
    with pytest.raises(ValueError, match="'x' appears twice"):
        run(work)


def test_a_cost_model_must_return_positive_times():
    class Zero(LinearCost):
        def step_time(self, shape):
            return 0.0

    with pytest.raises(ValueError, match="positive"):
        Simulator(tiny_args(num_kv_blocks=8), Zero()).run([BenchRequest("a", 0.0, [5, 6], 2)])


def test_the_kv_pool_defaults_to_the_cost_models_memory():
    # 1 MiB at tiny's K+V x 2 layers x 2 KV heads x 16 dims x 4 bytes = 512 B per token:
    # 2048 tokens = 128 blocks of 16, which also caps the model length at 2048.
    sim = Simulator(tiny_args(), LinearCost(kv_memory=1 << 20))
    assert sim.num_kv_blocks == 128
    assert sim.max_model_len == 2048
    # An explicit size wins, as in the engine.
    assert Simulator(tiny_args(num_kv_blocks=7), LinearCost()).num_kv_blocks == 7


def test_runs_are_repeatable_and_independent():
    work = make_workload(25, seed=6)
    sim = Simulator(tiny_args(num_kv_blocks=48, max_num_seqs=4), COST)
    a, b = sim.run(work), sim.run(work)
    assert [(m.first_token_time, m.finished_time) for m in a.metrics] == \
        [(m.first_token_time, m.finished_time) for m in b.metrics]
    assert a.num_steps == b.num_steps


def test_batch_shape_by_hand():
    from conveyor.core.batch_shape import batch_shape
    from conveyor.core.scheduler_output import (
        CachedRequestData,
        NewRequestData,
        SchedulerOutput,
    )
    from conveyor.sampling_params import SamplingParams

    sp = SamplingParams()
    out = SchedulerOutput(
        # a fresh prompt of 5 (all computed now, samples); a chunk of 4 after 8 cached
        new_reqs=[NewRequestData("p", [1] * 5, [], sp, [0], 0),
                  NewRequestData("c", [1] * 20, [], sp, [1, 2], 8)],
        # two decodes at contexts 10 and 30
        cached_reqs=[CachedRequestData("d1", [], 9), CachedRequestData("d2", [], 29)],
        num_scheduled_tokens={"p": 5, "c": 4, "d1": 1, "d2": 1},
        total_num_scheduled_tokens=11, sampling_req_ids={"p", "d1", "d2"})
    s = batch_shape(out)
    assert (s.num_prefill_tokens, s.num_prefills, s.num_decodes, s.num_sampled) == (9, 2, 2, 3)
    assert s.prefill_attention == (5 * 6 // 2) + (4 * 8 + 4 * 5 // 2)  # 15 + 42
    assert s.prefill_context == 5 + 12
    assert (s.decode_context, s.max_decode_context) == (40, 30)
    assert s.num_tokens == 11 == out.total_num_scheduled_tokens


def test_the_step_cost_fits_split_is_batch_shapes():
    """The scheduler's per-step split (prefill tokens, decode rows) is ``batch_shape``'s,
    a verifying row (1 + its drafts) counted as decode rows, not as a prefill chunk."""
    from conveyor.core.batch_shape import batch_shape, prefill_and_decode_rows
    from conveyor.core.scheduler_output import (
        CachedRequestData,
        NewRequestData,
        SchedulerOutput,
    )
    from conveyor.sampling_params import SamplingParams

    sp = SamplingParams()
    out = SchedulerOutput(
        new_reqs=[NewRequestData("p", [1] * 5, [], sp, [0], 0)],
        cached_reqs=[CachedRequestData("d", [], 9), CachedRequestData("v", [], 29)],
        num_scheduled_tokens={"p": 5, "d": 1, "v": 3},
        total_num_scheduled_tokens=9, sampling_req_ids={"p", "d", "v"},
        scheduled_spec_tokens={"v": [7, 8]})
    s = batch_shape(out)
    assert prefill_and_decode_rows(out) == (s.num_prefill_tokens, s.num_decodes) == (5, 4)
    decodes = SchedulerOutput(  # a token a row (one a 1-token prompt): all decode rows
        new_reqs=[NewRequestData("p1", [1], [], sp, [0], 0)],
        cached_reqs=[CachedRequestData("d", [], 9), CachedRequestData("e", [], 4)],
        num_scheduled_tokens={"p1": 1, "d": 1, "e": 1}, total_num_scheduled_tokens=3,
        sampling_req_ids={"p1", "d", "e"})
    s = batch_shape(decodes)
    assert prefill_and_decode_rows(decodes) == (s.num_prefill_tokens, s.num_decodes) == (0, 3)


def test_bad_scheduling_fields_are_refused_like_the_engine():
    work = [BenchRequest("neg", 0.0, [5, 6], 2, slo_ttft_ms=-1.0),
            BenchRequest("empty-tenant", 0.0, [5, 6], 2, tenant=""),
            BenchRequest("ok", 0.0, [5, 6], 2, slo_ttft_ms=100.0)]
    res = run(work)
    assert "slo_ttft_ms must be a number > 0" in res.errors["neg"]
    assert "tenant must be a non-empty string" in res.errors["empty-tenant"]
    assert res.finished["ok"].slo_ttft_s == 0.1


def test_a_request_arriving_mid_step_joins_after_the_update(monkeypatch):
    """As in the engine's loop, the scheduler takes new requests between steps: one that
    arrives while a step runs is added after that step's update, before the next schedule."""
    from conveyor.core.scheduler import Scheduler

    log = []
    for name in ("add_request", "schedule", "update"):
        original = getattr(Scheduler, name)

        def spy(self, *args, _name=name, _original=original):
            log.append(_name if _name != "add_request" else f"add {args[0].request_id}")
            return _original(self, *args)

        monkeypatch.setattr(Scheduler, name, spy)
    # a's first step (10 tokens) runs from 0 to 0.02; b arrives at 0.005, mid-step.
    res = run([BenchRequest("a", 0.0, list(range(10, 20)), 2),
               BenchRequest("b", 0.005, list(range(30, 34)), 2)])
    assert log[:5] == ["add a", "schedule", "update", "add b", "schedule"]
    assert res.finished["b"].first_scheduled_time == pytest.approx(0.02)
    assert res.finished["b"].arrival_time == 0.005
