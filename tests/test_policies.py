"""Scheduling policies one by one: registry, config checks, queue structures, orderings,
and the per-request plumbing from ``LLM.generate`` to the policies and metrics."""

from __future__ import annotations

import heapq
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_harness import make_req

from conveyor.config import (
    POLICY_NAMES,
    PREDICTOR_NAMES,
    EngineArgs,
    PolicyConfig,
    SchedulerConfig,
)
from conveyor.core.policies import (
    POLICIES,
    FCFSPolicy,
    PolicyContext,
    SchedulingPolicy,
    make_policy,
    register_policy,
    register_predictor,
)
from conveyor.core.policies.queues import FifoQueue, LazyHeap
from conveyor.request import RequestStatus

ALL = ("fcfs", "sjf", "priority", "fair", "edf", "lpm")


def order(policy: SchedulingPolicy, now: float = 0.0) -> list[str]:
    """Drain a policy: the ids in the order it offers them."""
    out = []
    while (req := policy.peek(now)) is not None:
        policy.pop(req)
        policy.on_admitted(req, now)
        out.append(req.request_id)
    assert len(policy) == 0
    return out


# ---- registry and configuration ----------------------------------------------------------
def test_every_policy_is_registered_and_unknown_names_list_them() -> None:
    assert set(ALL) <= set(POLICIES)
    for name in ALL:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="valid policies: edf, fair, fcfs, lpm, priority"):
        make_policy("lifo")
    with pytest.raises(ValueError, match=r"unknown scheduling policy 'lifo'.*fcfs"):
        SchedulerConfig(scheduling_policy="lifo")


def test_a_registered_policy_is_accepted_by_name() -> None:
    @register_policy
    class Newest(FCFSPolicy):
        name = "test-newest"

        def add(self, request, now):
            self._queue.push_front(request)

    try:
        cfg = SchedulerConfig(scheduling_policy="test-newest")
        policy = make_policy(cfg.scheduling_policy)
        for i in range(3):
            policy.add(make_req(f"r{i}", 2, 2), 0.0)
        assert order(policy) == ["r2", "r1", "r0"]
    finally:
        del POLICIES["test-newest"]
        POLICY_NAMES.discard("test-newest")


@pytest.mark.parametrize("kwargs, field", [
    (dict(sjf_aging_s=-1.0), "sjf_aging_s"),
    (dict(sjf_overtake_factor=-1.0), "sjf_overtake_factor"),
    (dict(sjf_overtake_factor=math.inf), "sjf_overtake_factor"),
    (dict(sjf_predictor="oracle"), "sjf_predictor"),
    (dict(fair_input_weight=-1.0), "fair_input_weight"),
    (dict(fair_input_weight=0.0, fair_output_weight=0.0), "fair_input_weight"),
    (dict(fair_preempt_gap=-1.0), "fair_preempt_gap"),
    (dict(fair_rejoin_credit=-1.0), "fair_rejoin_credit"),
    (dict(fair_rejoin_credit=math.inf), "fair_rejoin_credit"),
    (dict(tenant_weights=(("a", 0.0),)), "tenant_weights"),
    (dict(default_slo_ttft_s=0.0), "default_slo_ttft_s"),
    (dict(lpm_window=0), "lpm_window"),
])
def test_bad_policy_config_names_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        PolicyConfig(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_queue_len=-1), "max_queue_len"),
    (dict(max_queue_wait_s=-0.5), "max_queue_wait_s"),
    (dict(max_preemptions_per_request=-1), "max_preemptions_per_request"),
])
def test_bad_shared_controls_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kwargs)


def test_cli_flags_reach_the_policy_config() -> None:
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args([
        "--scheduling-policy", "fair", "--sjf-aging-s", "4", "--sjf-predictor", "max_tokens",
        "--sjf-overtake-factor", "50",
        "--fair-input-weight", "0.5", "--fair-output-weight", "3", "--tenant-weights", "a=2,b=1",
        "--default-slo-ttft-ms", "250", "--default-slo-tpot-ms", "40", "--lpm-window", "8",
        "--max-queue-len", "100", "--max-queue-wait-s", "9", "--queue-wait-action", "reject",
        "--max-preemptions-per-request", "2", "--fair-preempt-gap", "off",
        "--fair-rejoin-credit", "100"])
    cfg = EngineArgs.from_cli_args(args).scheduler_config()
    assert cfg.scheduling_policy == "fair" and cfg.max_queue_len == 100
    assert cfg.max_queue_wait_s == 9 and cfg.queue_wait_action == "reject"
    assert cfg.max_preemptions_per_request == 2
    assert cfg.policy == PolicyConfig(
        sjf_aging_s=4.0, sjf_overtake_factor=50.0, sjf_predictor="max_tokens",
        fair_input_weight=0.5,
        fair_output_weight=3.0, fair_preempt_gap=None, fair_rejoin_credit=100.0,
        tenant_weights=(("a", 2.0), ("b", 1.0)), default_slo_ttft_s=0.25,
        default_slo_tpot_s=0.04, lpm_window=8)
    with pytest.raises(SystemExit):
        parser.parse_args(["--tenant-weights", "a:2"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--fair-preempt-gap", "never"])
    defaults = EngineArgs.from_cli_args(parser.parse_args([])).scheduler_config().policy
    assert defaults == PolicyConfig()  # the CLI and the dataclass agree


# ---- queue structures --------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push", "remove", "pop"]), st.integers(0, 12),
                          st.integers(0, 5)), max_size=200))
def test_lazy_heap_matches_a_sorted_model(ops) -> None:
    heap: LazyHeap[str] = LazyHeap()
    model: dict[int, tuple[int, int]] = {}  # id -> (key, push order)
    pushes = 0
    for op, item, key in ops:
        if op == "push":
            heap.push(item, key, f"v{item}")
            model[item] = (key, pushes)
            pushes += 1
        elif op == "remove":
            assert heap.remove(item) == (item in model)
            model.pop(item, None)
        else:
            got = heap.pop()
            if not model:
                assert got is None
                continue
            best = min(model, key=lambda i: model[i])
            assert got == (model[best][0], f"v{best}")
            del model[best]
        assert len(heap) == len(model)
        assert sorted(heap) == sorted(f"v{i}" for i in model)
        assert len(heap._heap) <= 2 * len(model) + 65, "dead entries must be compacted"


def test_lazy_heap_stays_small_under_constant_rekeying() -> None:
    heap: LazyHeap[str] = LazyHeap()
    for step in range(10_000):
        heap.push(step % 3, step, "x")
    assert len(heap) == 3 and len(heap._heap) <= 2 * 3 + 65
    assert heapq.nsmallest(1, heap._heap)[0][0] >= 10_000 - 3 - 70


def test_fifo_queue_front_and_removal() -> None:
    q = FifoQueue()
    a, b, c = (make_req(x, 1, 1) for x in "abc")
    q.append(a)
    q.append(b)
    q.push_front(c)
    assert [r.request_id for r in q] == ["c", "a", "b"]
    assert q.remove(a) and not q.remove(a)
    assert q.first() is c and len(q) == 2 and b in q and a not in q


# ---- orderings ---------------------------------------------------------------------------
def test_fcfs_arrival_order_with_preempted_at_the_front() -> None:
    p = make_policy("fcfs")
    for i in range(3):
        p.add(make_req(f"r{i}", 2, 2, arrival=float(i)), float(i))
    p.requeue(make_req("back", 2, 2, arrival=9.0), 9.0)
    assert order(p) == ["back", "r0", "r1", "r2"]


def test_sjf_orders_by_remaining_work_and_uses_the_hint() -> None:
    p = make_policy("sjf", PolicyConfig(sjf_aging_s=0.0))  # pure SJF
    p.add(make_req("long", 10, 50, arrival=0.0), 0.0)  # work 60
    p.add(make_req("hinted", 10, 50, arrival=1.0, expected=5), 1.0)  # work 15
    p.add(make_req("short", 20, 10, arrival=2.0), 2.0)  # work 30
    p.add(make_req("tie", 20, 10, arrival=3.0), 3.0)  # work 30, later
    assert order(p) == ["hinted", "short", "tie", "long"]
    p = make_policy("sjf", PolicyConfig(sjf_predictor="max_tokens", sjf_aging_s=0.0))
    p.add(make_req("long", 10, 50), 0.0)
    p.add(make_req("hinted", 10, 50, expected=5), 0.0)
    p.add(make_req("short", 20, 10), 0.0)
    assert order(p)[0] == "short", "the max_tokens predictor ignores hints"


def test_sjf_counts_recomputation_of_a_preempted_request() -> None:
    p = make_policy("sjf")
    pre = make_req("pre", 10, 40)
    for t in range(30):
        pre.append_output_token(t)
    assert p.remaining_work(pre) == 40 + 10  # 40 tokens to recompute, 10 left to generate
    pre.num_computed_tokens = 40
    assert p.remaining_work(pre) == 10


def test_sjf_predictor_is_pluggable() -> None:
    register_predictor("test-oracle", lambda r: 1)
    try:
        p = make_policy("sjf", PolicyConfig(sjf_predictor="test-oracle", sjf_aging_s=0.0))
        p.add(make_req("a", 10, 50), 0.0)
        p.add(make_req("b", 12, 5), 0.0)
        assert order(p) == ["a", "b"]  # 10 + 1 < 12 + 1
    finally:
        from conveyor.core.policies import PREDICTORS

        del PREDICTORS["test-oracle"]
        PREDICTOR_NAMES.discard("test-oracle")


def test_sjf_aging_needs_the_model_length_and_lets_old_requests_first() -> None:
    p = make_policy("sjf", PolicyConfig(sjf_aging_s=8.0))
    with pytest.raises(RuntimeError, match="max_model_len"):
        p.add(make_req("a", 2, 2), 0.0)
    p.bind(PolicyContext(max_model_len=256))
    # 8 s of age are worth 256 tokens of work; key = work / 256 + arrival / 8
    p.add(make_req("old-long", 100, 92, arrival=0.0), 20.0)  # 0.75
    p.add(make_req("mid", 32, 32, arrival=4.0), 20.0)  # 0.25 + 0.5: tie, arrived later
    p.add(make_req("short-8s-later", 1, 1, arrival=8.0), 20.0)  # 2/256 + 1
    p.add(make_req("short-5s-later", 1, 1, arrival=5.0), 20.0)  # 2/256 + 0.625
    assert order(p, 20.0) == ["short-5s-later", "old-long", "mid", "short-8s-later"]


def test_priority_class_then_arrival_and_strictly_less_urgent_victims() -> None:
    p = make_policy("priority")
    for rid, prio, t in [("a", 1, 0.0), ("b", 0, 1.0), ("c", 1, 0.5), ("d", -1, 2.0)]:
        p.add(make_req(rid, 2, 2, arrival=t, priority=prio), t)
    assert order(p) == ["d", "b", "a", "c"]
    running = [make_req("r0", 2, 2, priority=0, arrival=0.0),
               make_req("r1", 2, 2, priority=2, arrival=0.0),
               make_req("r2", 2, 2, priority=2, arrival=1.0)]
    assert p.victim_for_waiting(running, make_req("w", 2, 2, priority=1)).request_id == "r2"
    assert p.victim_for_waiting(running[:1], make_req("w", 2, 2, priority=1)) is None
    assert p.victim_for_waiting(running, make_req("w", 2, 2, priority=2)) is None
    assert p.select_victim(running, running[0]).request_id == "r2"
    assert [r.request_id for r in p.order_running(running[::-1])] == ["r0", "r1", "r2"]


def test_fair_serves_the_least_served_tenant_and_lifts_newcomers() -> None:
    p = make_policy("fair", PolicyConfig(fair_input_weight=1.0, fair_output_weight=2.0,
                                         fair_rejoin_credit=0.0))  # plain VTC lift
    for i in range(3):
        p.add(make_req(f"a{i}", 10, 5, tenant="a", arrival=float(i)), float(i))
    p.add(make_req("b0", 4, 5, tenant="b", arrival=3.0), 3.0)
    first = p.peek(3.0)
    assert first.request_id == "a0"  # tie at 0: a joined the backlog first
    p.pop(first)
    p.on_admitted(first, 3.0)  # a: 10
    nxt = p.peek(3.0)
    assert nxt.request_id == "b0"
    p.pop(nxt)
    p.on_admitted(nxt, 3.0)  # b: 4, and b leaves the backlog
    p.on_tokens_generated(nxt, 5)  # b: 14
    assert p.counters == {"a": 10.0, "b": 14.0}
    assert p.peek(3.0).request_id == "a1"
    # c arrives long after: it starts at the smallest backlogged counter (a's), not 0.
    p.add(make_req("c0", 1, 1, tenant="c"), 4.0)
    assert p.counters["c"] == 10.0


def test_fair_weights_divide_the_charge() -> None:
    p = make_policy("fair", PolicyConfig(tenant_weights=(("gold", 4.0),)))
    gold, free = make_req("g", 8, 4, tenant="gold"), make_req("f", 8, 4, tenant="free")
    for r in (gold, free):
        p.add(r, 0.0)
    for r in (gold, free):
        p.pop(r)
        p.on_admitted(r, 0.0)
        p.on_tokens_generated(r, 4)
    assert p.counters == {"gold": (8 + 2 * 4) / 4, "free": 8 + 2 * 4}


def test_fair_floor_keeps_an_idle_tenant_from_banking_credit() -> None:
    p = make_policy("fair", PolicyConfig(fair_rejoin_credit=0.0))
    a = make_req("a", 100, 1, tenant="a")
    p.add(a, 0.0)
    p.pop(a)
    p.on_admitted(a, 0.0)  # a: 100; a left the backlog last
    p.on_tokens_generated(a, 1)  # a: 102
    b = make_req("b", 1, 1, tenant="b")
    p.add(b, 1.0)  # nobody is backlogged: b starts at a's current counter, not at 0
    assert p.counters["b"] == 102.0
    p.pop(b)
    p.on_admitted(b, 1.0)  # b: 103, now b left last
    late = make_req("z", 1, 1, tenant="z")
    p.add(late, 2.0)
    assert p.counters["z"] == 103.0


def test_fair_rejoin_credit_is_bounded_and_never_compounds() -> None:
    p = make_policy("fair", PolicyConfig(fair_rejoin_credit=50.0))
    a = make_req("a", 100, 1, tenant="a")
    p.add(a, 0.0)
    p.pop(a)
    p.on_admitted(a, 0.0)
    p.on_tokens_generated(a, 1)  # a: 102, and a left the backlog last
    b = make_req("b", 1, 1, tenant="b")
    p.add(b, 1.0)  # b starts 50 below a's counter, not at 0
    assert p.counters["b"] == 52.0
    p.pop(b)
    p.on_admitted(b, 1.0)  # b: 53, now b left last
    # The lift level stays at 102: z gets the same 50 of credit, not 50 below b's 53.
    p.add(make_req("z", 1, 1, tenant="z"), 2.0)
    assert p.counters["z"] == 52.0


def test_fair_admission_preemption_names_the_most_served_tenant_with_a_slot_surplus() -> None:
    p = make_policy("fair", PolicyConfig(fair_preempt_gap=10.0))
    p.counters.update({"heavy": 100.0, "mid": 60.0, "light": 85.0})
    heavy = [make_req(f"h{i}", 4, 4, tenant="heavy") for i in range(3)]
    for i, r in enumerate(heavy):
        r.admitted_seq = i
    light = make_req("l", 4, 4, tenant="light")
    assert p.victim_for_waiting(heavy, light) is heavy[2]  # youngest of the most served
    p.counters["light"] = 90.0  # gap of exactly 10: not more than fair_preempt_gap
    assert p.victim_for_waiting(heavy, light) is None
    # mid is 40 behind, but heavy's 2 slots would drop below mid's 1 + 1 after a swap.
    mid = make_req("m", 4, 4, tenant="mid")
    assert p.victim_for_waiting(heavy[:1], mid) is None
    assert p.victim_for_waiting(heavy[:2], mid) is heavy[1]
    off = make_policy("fair", PolicyConfig(fair_preempt_gap=None))
    off.counters.update(p.counters)
    assert off.victim_for_waiting(heavy, mid) is None


def test_edf_on_time_first_then_late_then_best_effort() -> None:
    p = make_policy("edf", PolicyConfig(default_slo_tpot_s=0.1))
    p.add(make_req("loose", 2, 2, arrival=0.0, slo_ttft_s=50.0), 0.0)  # due 50
    p.add(make_req("tight", 2, 2, arrival=1.0, slo_ttft_s=2.0), 1.0)  # due 3
    p.add(make_req("none", 2, 2, arrival=0.0), 0.0)  # no TTFT target
    p.add(make_req("soon", 2, 2, arrival=0.0, slo_ttft_s=5.0), 0.0)  # due 5
    pre = make_req("pre", 2, 8, arrival=0.0, slo_ttft_s=1.0)
    pre.first_token_time = 1.0
    for t in range(3):
        pre.append_output_token(t)
    p.requeue(pre, 2.0)  # 3 tokens: the 4th is due 1.0 + 3 * 0.1 = 1.3 < now: late
    assert p.deadline(pre) == pytest.approx(1.3)
    # At t=4 "tight" (due 3) has become late too: on time first, by deadline.
    assert order(p, 4.0) == ["soon", "loose", "pre", "tight", "none"]


def test_edf_victim_has_the_most_slack() -> None:
    p = make_policy("edf")
    running = [make_req("urgent", 2, 2, slo_ttft_s=1.0), make_req("lax", 2, 2, slo_ttft_s=9.0),
               make_req("none", 2, 2)]
    assert p.select_victim(running, running[0]).request_id == "none"
    assert p.select_victim(running[:2], running[0]).request_id == "lax"
    assert [r.request_id for r in p.order_running(running[::-1])] == ["urgent", "lax", "none"]


def test_lpm_prefers_cached_prefixes_within_the_window() -> None:
    cached = {"hit-small": 16, "hit-big": 48, "far-hit": 64}
    p = make_policy("lpm", PolicyConfig(lpm_window=4))
    p.bind(PolicyContext(cached_prefix_tokens=lambda r: cached.get(r.request_id, 0)))
    for rid in ["miss0", "hit-small", "miss1", "hit-big", "far-hit", "miss2"]:
        p.add(make_req(rid, 70, 2), 0.0)
    # far-hit is 5th in the queue, outside the window of 4: not considered yet.
    got = order(p)
    assert got[:2] == ["hit-big", "far-hit"]  # after hit-big leaves, far-hit is 4th
    assert got[2:] == ["hit-small", "miss0", "miss1", "miss2"]


def test_lpm_without_hits_is_fcfs() -> None:
    p = make_policy("lpm", PolicyConfig(lpm_window=3))
    for i in range(6):
        p.add(make_req(f"r{i}", 5, 2), 0.0)
    p.requeue(make_req("pre", 5, 2), 0.0)
    assert order(p) == ["pre"] + [f"r{i}" for i in range(6)]


def test_lpm_forces_a_request_overtaken_window_times() -> None:
    p = make_policy("lpm", PolicyConfig(lpm_window=2))
    p.bind(PolicyContext(cached_prefix_tokens=lambda r: 0 if r.request_id == "cold" else 8))
    p.add(make_req("cold", 5, 2), 0.0)
    for i in range(5):
        p.add(make_req(f"hot{i}", 5, 2), 0.0)
    assert order(p) == ["hot0", "hot1", "cold", "hot2", "hot3", "hot4"]
    assert p.stats()["num_forced"] == 1


# ---- plumbing through the engine ---------------------------------------------------------
@pytest.fixture(scope="module")
def path() -> str:
    from helpers import make_checkpoint

    return make_checkpoint("llama")


def test_generate_carries_priority_tenant_and_slos_to_requests_and_metrics(path) -> None:
    from conveyor import LLM, SamplingParams

    llm = LLM(path, dtype="float32", scheduling_policy="edf", default_slo_ttft_ms=500.0,
              default_slo_tpot_ms=100.0)
    seen = {}
    orig_add = llm.engine.scheduler.add_request

    def spy(req, now):
        seen[req.request_id] = req
        orig_add(req, now)

    llm.engine.scheduler.add_request = spy
    outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, temperature=0.0),
                        priority=[3, -1], tenant=["acme", None], slo_ttft_ms=[50.0, None],
                        slo_tpot_ms=None)
    a, b = (seen[o.request_id] for o in outs)
    assert (a.priority, a.tenant, a.slo_ttft_s, a.slo_tpot_s) == (3, "acme", 0.05, 0.1)
    assert (b.priority, b.tenant, b.slo_ttft_s, b.slo_tpot_s) == (-1, "default", 0.5, 0.1)
    m = outs[0].metrics
    assert (m.priority, m.tenant, m.slo_ttft_s, m.slo_tpot_s) == (3, "acme", 0.05, 0.1)
    assert m.slo_attained in (True, False)
    stats = llm.stats()
    assert stats["scheduling_policy"] == "edf"
    assert stats["policy"]["num_admitted_on_time"] + stats["policy"]["num_admitted_late"] == 2
    for key in ("num_admission_preemptions", "num_wait_rejected", "num_overdue"):
        assert stats[key] == 0


@pytest.mark.parametrize("kwargs, field", [
    (dict(priority=["high", 0]), "priority"),
    (dict(tenant=["", "b"]), "tenant"),
    (dict(slo_ttft_ms=[-5.0, None]), "slo_ttft_ms"),
    (dict(slo_tpot_ms=[float("nan"), 1.0]), "slo_tpot_ms"),
    (dict(priority=[1]), "priority has 1 entries for 2 prompts"),
])
def test_bad_scheduling_fields_fail_before_any_work(path, kwargs, field) -> None:
    from conveyor import LLM

    llm = LLM(path, dtype="float32")
    with pytest.raises(ValueError, match=field):
        llm.generate([[5, 6], [7, 8]], **kwargs)
    assert llm.stats()["num_steps"] == 0 and not llm.engine.has_unfinished_requests()


def test_unknown_policy_fails_at_construction_listing_valid_ones(path) -> None:
    from conveyor import LLM

    with pytest.raises(ValueError, match="valid policies: edf, fair, fcfs, lpm, priority, sjf"):
        LLM(path, dtype="float32", scheduling_policy="round-robin")


def test_queue_full_counts_every_sample_of_a_request(path) -> None:
    from conveyor import LLM, SamplingParams
    from conveyor.engine.llm_engine import QueueFullError

    llm = LLM(path, dtype="float32", max_queue_len=3)
    eng = llm.engine
    eng.add_request([5, 6], SamplingParams(max_tokens=2, n=2))
    with pytest.raises(QueueFullError, match="3 requests"):
        eng.add_request([5, 6], SamplingParams(max_tokens=2, n=2))  # 2 + 2 > 3
    eng.add_request([5, 6], SamplingParams(max_tokens=2))  # 2 + 1 fits
    assert eng.scheduler.num_waiting == 3
    assert llm.stats()["num_rejected"] == 1
    while eng.has_unfinished_requests():
        eng.step()


def test_queue_wait_reject_reaches_the_user_as_an_abort(path) -> None:
    from conveyor import SamplingParams
    from conveyor.engine.llm_engine import LLMEngine

    clock = [0.0]
    eng = LLMEngine(EngineArgs(model=path, dtype="float32", max_num_seqs=1,
                               max_queue_wait_s=5.0, queue_wait_action="reject"),
                    clock=lambda: clock[0])
    eng.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0), request_id="a")
    eng.add_request([8, 9], SamplingParams(max_tokens=4, temperature=0.0), request_id="b")
    finished = {}
    while eng.has_unfinished_requests():
        clock[0] += 2.0  # every step takes 2 s: b waits behind a
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["a"].outputs[0].finish_reason == "length"
    b = finished["b"]
    assert b.outputs[0].finish_reason == "abort" and b.outputs[0].token_ids == []
    # Seen at the first step at or past 5 s of waiting: t = 6.
    assert b.metrics.finished_time - b.metrics.arrival_time == pytest.approx(6.0)
    assert b.metrics.slo_attained is None
    assert eng.stats()["num_wait_rejected"] == 1
    assert eng.scheduler.requests == {} and eng.kv.pool.num_used_blocks == 0


def test_rejected_status_is_final() -> None:
    assert RequestStatus.FINISHED_REJECTED.is_finished
    assert RequestStatus.FINISHED_REJECTED.finish_reason == "abort"
