"""Scheduler behaviour and invariants with a fake runner (no torch, no model)."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.request import RequestStatus

from helpers import fake_execute, make_request, make_scheduler


def run_to_completion(sched, arrivals=None, max_steps=5000, check=True):
    """Step until every request finished; returns the list of SchedulerOutputs."""
    outs = []
    now = 0.0
    pending = sorted(arrivals or [], key=lambda r: r.arrival_time)
    while (sched.has_unfinished() or pending) and len(outs) < max_steps:
        while pending and pending[0].arrival_time <= now:
            sched.add_request(pending.pop(0), now)
        out = sched.schedule(now)
        assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= sched.config.max_num_seqs
        sched.update(out, fake_execute(out), now)
        if check:
            sched.check_invariants()
        outs.append(out)
        now += 1.0
    return outs


def test_scheduler_never_imports_torch() -> None:
    code = ("import sys; import conveyor.core.scheduler, conveyor.core.kv_cache_manager; "
            "assert 'torch' not in sys.modules, 'the scheduler pulled in torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_decodes_go_first_and_prefill_is_chunked() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    a = make_request("a", 4, 5)
    sched.add_request(a, 0.0)
    out = sched.schedule(0.0)
    sched.update(out, fake_execute(out), 0.0)
    b = make_request("b", 30, 5)
    sched.add_request(b, 1.0)
    out = sched.schedule(1.0)
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}, "a decodes, b gets the rest"
    assert "b" not in out.sampling_req_ids
    sched.update(out, fake_execute(out), 1.0)
    out = sched.schedule(2.0)
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}


def test_finished_request_frees_its_slot_for_the_next_step() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i, n in enumerate([1, 6, 3]):
        sched.add_request(make_request(f"r{i}", 4, n), 0.0)
    out = sched.schedule(0.0)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    updates = sched.update(out, fake_execute(out), 0.0)
    assert [u.request_id for u in updates if u.finished] == ["r0"]
    out = sched.schedule(1.0)
    assert set(out.num_scheduled_tokens) == {"r1", "r2"}, "r2 takes r0's slot at once"
    assert "r0" in out.finished_req_ids


def test_preemption_takes_the_most_recent_and_requeues_it_first() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=4,
                           max_num_batched_tokens=64)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 7, 20), float(i))
    outs = run_to_completion(sched)
    assert sched.stats.num_preemptions > 0
    first = next(o for o in outs if o.preempted_req_ids)
    assert first.preempted_req_ids == {"r2"}, "the most recently admitted goes first"
    assert all(len(o.num_scheduled_tokens) > 0 for o in outs)


def test_static_batching_waits_for_the_whole_batch() -> None:
    sched = make_scheduler(max_num_seqs=2, batching="static", max_num_batched_tokens=64)
    for i, n in enumerate([2, 8, 3, 3]):
        sched.add_request(make_request(f"r{i}", 3, n), 0.0)
    outs = run_to_completion(sched)
    batches = [set(o.num_scheduled_tokens) for o in outs]
    # r0 finishes after 2 steps but r2 may not start before r1 (8 tokens) is done.
    start_r2 = next(i for i, b in enumerate(batches) if "r2" in b)
    end_r1 = max(i for i, b in enumerate(batches) if "r1" in b)
    assert start_r2 == end_r1 + 1
    assert batches[2] == {"r1"}, "the finished slot stays empty in static mode"


def test_continuous_beats_static_in_steps() -> None:
    lengths = [2, 30, 3, 25, 4, 4, 28, 2]

    def steps(batching):
        sched = make_scheduler(max_num_seqs=2, batching=batching, num_blocks=128,
                               max_num_batched_tokens=64)
        for i, n in enumerate(lengths):
            sched.add_request(make_request(f"r{i}", 3, n), 0.0)
        return len(run_to_completion(sched))

    assert steps("continuous") < steps("static")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 5)),
                min_size=1, max_size=25),
       st.integers(4, 40), st.integers(1, 6), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from(["continuous", "static"]), st.booleans())
def test_random_streams_keep_every_invariant(reqs, budget, max_seqs, block_size, batching,
                                             caching) -> None:
    """Budget and caps hold every step, no block leaks, and every request finishes."""
    num_blocks = max(4, 64 // block_size)
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size,
                           max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                           batching=batching, enable_prefix_caching=caching)
    arrivals = []
    for i, (prompt, out_len, at) in enumerate(reqs):
        prompt = min(prompt, sched.max_model_len - out_len - 1)
        if prompt < 1:
            continue
        arrivals.append(make_request(f"r{i}", prompt, out_len, arrival=float(at)))
    finished = {}
    orig_update = sched.update

    def update(out, run, now):
        ups = orig_update(out, run, now)
        for u in ups:
            if u.finished:
                finished[u.request_id] = u.status
        return ups

    sched.update = update
    run_to_completion(sched, arrivals)
    assert not sched.has_unfinished()
    assert set(finished) == {r.request_id for r in arrivals}
    assert all(s == RequestStatus.FINISHED_LENGTH_CAPPED for s in finished.values())
    assert all(len(r.output_token_ids) == r.max_tokens for r in arrivals)
    assert sched.kv.num_free_blocks == num_blocks
