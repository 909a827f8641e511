"""``--max-loras`` as a constraint of the step (core/lora_gate.py), on a virtual clock with
a fake runner: never more adapters in a step or in run than max_loras, requests of other
adapters wait without blocking those that can run, no adapter starves under another's
burst, and the prefix cache is keyed by adapter."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_harness import Sim, make_req

from conveyor.config.lora import LoRARequest
from conveyor.core.kv_cache_manager import KVCacheManager

from helpers import make_scheduler

POLICIES = ("fcfs", "sjf", "priority", "fair", "edf", "lpm")


def lora(i: int) -> LoRARequest | None:
    return LoRARequest(f"a{i}", i, f"/adapters/a{i}") if i else None


def adapters_of(sim: Sim, ids) -> set[int]:
    return {sim.all[rid].lora_id for rid in ids} - {0}


@settings(max_examples=40, deadline=None)
@given(workload=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 10), st.integers(0, 15),
                                   st.integers(0, 5)), min_size=1, max_size=30),
       max_loras=st.integers(1, 3), policy=st.sampled_from(POLICIES),
       blocks=st.integers(12, 64))
def test_max_loras_holds_and_everything_finishes(workload, max_loras, policy, blocks):
    reqs = [make_req(f"r{i}", p, m, arrival=a, lora_request=lora(k))
            for i, (p, m, a, k) in enumerate(workload)]
    sched = make_scheduler(num_blocks=blocks, scheduling_policy=policy, max_loras=max_loras,
                           max_model_len=48, enable_prefix_caching=True)
    sim = Sim(sched, reqs)
    for rec in sim.run():  # (run() fails if a request never finishes: none starves)
        assert len(adapters_of(sim, rec.out.num_scheduled_tokens)) <= max_loras
        assert len(adapters_of(sim, rec.running)) <= max_loras
    for rid, req in sim.all.items():
        assert len(req.output_token_ids) == req.max_tokens, rid


@pytest.mark.parametrize("max_cpu_loras", [2, 3])
def test_other_adapters_pass_a_blocked_one(max_cpu_loras):
    """max_loras 2 with a1 and a3 running: the queue's head (a2) waits, the base request
    and a3's second request behind it are admitted in the same step; a1, which entered
    first, drains (its second request waits) so that a2 gets the next slot. Adapters are
    loaded ahead (core/lora_loads.py): with room for a third (max_cpu_loras 3) a2 is ready
    when a1 leaves and enters in the next step; with room for two only, a1's release and
    a2's load take one step more."""
    sched = make_scheduler(max_loras=2, max_num_batched_tokens=64,
                           max_cpu_loras=max_cpu_loras)
    sim = Sim(sched, [make_req("a1-first", 4, 6, lora_request=lora(1)),
                      make_req("a3-first", 4, 9, lora_request=lora(3))])
    rec = sim.step()
    assert not rec.admitted and rec.out.lora_load_ids == [1, 3]  # loads ordered, no stall
    sim.step()
    for req in (make_req("a2", 4, 3, arrival=1, lora_request=lora(2)),
                make_req("base", 4, 3, arrival=1),
                make_req("a3-second", 4, 3, arrival=1, lora_request=lora(3)),
                make_req("a1-second", 4, 3, arrival=1, lora_request=lora(1))):
        sim.add(req)
    rec = sim.step()
    assert set(rec.admitted) == {"base", "a3-second"}
    assert {r.request_id for r in sched.policy.waiting()} == {"a2", "a1-second"}
    sim.run()
    a1_done = max(s.index for s in sim.steps if "a1-first" in s.finished)
    # the slot a1 left goes to a2
    assert sim.admission_step("a2") == a1_done + (1 if max_cpu_loras == 3 else 2)
    assert sim.admission_step("a1-second") > sim.admission_step("a2")


def test_no_adapter_starves_under_a_burst():
    """a1 keeps sending (a request every step for 200 steps) while a2 sends one: a2 runs
    long before a1's burst ends (a1 drains: its queued requests wait until its running ones
    finish and a2 takes the slot). Without the drain rule a2 would wait ~200 steps."""
    burst = [make_req(f"a1-{i}", 4, 8, arrival=i, lora_request=lora(1)) for i in range(200)]
    late = make_req("a2", 4, 4, arrival=3, lora_request=lora(2))
    sched = make_scheduler(max_loras=1, num_blocks=256, max_num_seqs=8,
                           max_num_batched_tokens=64)
    sim = Sim(sched, [*burst, late])
    sim.run()
    admitted_at = sim.admission_step("a2")
    assert admitted_at < 3 + 2 * 8 + 2, admitted_at  # one drain of a1's 8-token requests
    # ...and a1 resumes afterwards: its last request is served too.
    assert len(sim.all["a1-199"].output_token_ids) == 8


def test_tenant_defaults_to_adapter():
    """The fair policy counts an adapter's requests under the adapter (``lora:NAME``) when
    the request names no tenant (the engine core sets it so)."""
    from conveyor.config.lora import lora_tenant

    assert lora_tenant("default", lora(1)) == "lora:a1"
    assert lora_tenant("acme", lora(1)) == "acme"
    assert lora_tenant("default", None) == "default"


def test_prefix_cache_keyed_by_adapter():
    kv = KVCacheManager(32, 4, enable_prefix_caching=True)
    prompt = list(range(5, 22))
    first = make_req("base", 0, 4, prompt=prompt)
    assert kv.allocate_slots(first, len(prompt)) is not None
    kv.cache_computed_blocks(first, len(prompt))
    assert kv.get_computed_blocks(make_req("base2", 0, 4, prompt=prompt)).num_tokens == 16
    other = make_req("a1", 0, 4, prompt=prompt, lora_request=lora(1))
    assert kv.get_computed_blocks(other).num_tokens == 0  # the base model's K/V is not a1's
    assert kv.allocate_slots(other, len(prompt)) is not None
    kv.cache_computed_blocks(other, len(prompt))
    again = make_req("a1-again", 0, 4, prompt=prompt, lora_request=lora(1))
    assert kv.get_computed_blocks(again).num_tokens == 16
    assert kv.get_computed_blocks(
        make_req("a2", 0, 4, prompt=prompt, lora_request=lora(2))).num_tokens == 0


@settings(max_examples=40, deadline=None)
@given(workload=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 8), st.integers(0, 10),
                                   st.integers(0, 5)), min_size=1, max_size=25),
       max_loras=st.integers(1, 3), extra_slots=st.integers(0, 2),
       delays=st.lists(st.integers(0, 6), min_size=6, max_size=6),
       failing=st.sets(st.integers(1, 5), max_size=2))
def test_loads_ahead_hold_their_invariants(workload, max_loras, extra_slots, delays,
                                           failing):
    """Loads reported after random delays, some failing: at most max_cpu_loras adapters
    ordered and not released; a request runs only once its adapter's load was reported
    (and not released since); those of a failed adapter end with lora_load_failed, every
    other request runs to the end."""
    from conveyor.core.lora_loads import LORA_LOAD_FAILED
    from conveyor.core.scheduler_output import ModelRunnerOutput

    from helpers import fake_execute

    capacity = max_loras + extra_slots
    sched = make_scheduler(num_blocks=64, max_loras=max_loras, max_cpu_loras=capacity,
                           max_model_len=48)
    reqs = sorted((make_req(f"r{i}", p, m, arrival=a, lora_request=lora(k))
                   for i, (p, m, a, k) in enumerate(workload)), key=lambda r: r.arrival_time)
    ordered: set[int] = set()
    loaded: set[int] = set()
    in_flight: dict[int, int] = {}  # adapter id -> steps until its report
    ended: dict[str, object] = {}
    now, i = 0.0, 0
    for _ in range(2000):
        while i < len(reqs) and reqs[i].arrival_time <= now:
            sched.add_request(reqs[i], now)
            i += 1
        if i == len(reqs) and not sched.has_unfinished():
            break
        out = sched.schedule(now)
        for lora_id in out.lora_release:
            ordered.discard(lora_id)
            loaded.discard(lora_id)
            in_flight.pop(lora_id, None)
        for req in out.lora_load:
            ordered.add(req.lora_int_id)
            if req.lora_int_id not in loaded:
                in_flight[req.lora_int_id] = delays[req.lora_int_id]
        assert len(ordered) <= capacity
        for rid in out.num_scheduled_tokens:
            lora_id = sched.requests[rid].lora_id
            assert not lora_id or lora_id in loaded, (rid, lora_id)
        run: ModelRunnerOutput = fake_execute(out)
        run.lora_loaded, run.lora_failed = [], {}
        for lora_id, left in list(in_flight.items()):
            if left:
                in_flight[lora_id] = left - 1
            elif lora_id in failing:
                del in_flight[lora_id]
                ordered.discard(lora_id)
                run.lora_failed[lora_id] = "broken"
            else:
                del in_flight[lora_id]
                loaded.add(lora_id)
                run.lora_loaded.append(lora_id)
        for upd in sched.update(out, run, now + 0.5):
            if upd.finished:
                ended[upd.request_id] = upd
        now += 1.0
    else:
        raise AssertionError("did not finish")
    for req in reqs:
        upd = ended[req.request_id]
        if req.lora_id in failing:
            assert str(upd.stop_reason).startswith(LORA_LOAD_FAILED), upd
        else:
            assert len(req.output_token_ids) == req.max_tokens, req.request_id
