"""Properties of the policies and the shared controls, on a virtual clock with a fake runner.

Each property is checked on hypothesis-generated workloads, and where it guards
against a failure that another policy really has, a deterministic case shows that
failure (so the check can fail).
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from policy_harness import FakeRunner, Sim, StepRecord, fake_token, make_req

from conveyor.config import PolicyConfig
from conveyor.request import RequestStatus

from helpers import make_scheduler

ALL = ("fcfs", "sjf", "priority", "fair", "edf", "lpm")
SETTINGS = settings(max_examples=40, deadline=None)


def sched_for(policy: str, config: PolicyConfig | None = None, **kwargs):
    return make_scheduler(scheduling_policy=policy, policy=config or PolicyConfig(), **kwargs)


def assert_exact_outputs(sim: Sim) -> None:
    """Every request ran to max_tokens with the tokens its id and positions dictate."""
    for rid, req in sim.all.items():
        if sim.statuses.get(rid) == RequestStatus.FINISHED_REJECTED:
            assert req.output_token_ids == []
            continue
        assert sim.statuses[rid] == RequestStatus.FINISHED_LENGTH_CAPPED, rid
        want = [fake_token(rid, req.num_prompt_tokens + i) for i in range(req.max_tokens)]
        assert req.output_token_ids == want, rid


def waiting_at_each_admission(rec: StepRecord) -> list[tuple[str, set[str]]]:
    """For every admission of a step, in order: (admitted id, ids still waiting then)."""
    out = []
    for i, rid in enumerate(rec.admitted):
        out.append((rid, set(rec.waiting) | set(rec.admitted[i + 1:])))
    return out


workloads = st.lists(
    st.fixed_dictionaries({
        "prompt": st.integers(1, 40), "max_tokens": st.integers(1, 12),
        "arrival": st.integers(0, 12), "priority": st.integers(0, 3),
        "tenant": st.sampled_from("abc"), "ttft": st.one_of(st.none(), st.integers(1, 20)),
        "expected": st.one_of(st.none(), st.integers(1, 12)), "group": st.integers(0, 3),
    }),
    min_size=1, max_size=30)


def build(workload, shared_prefix: int = 0) -> list:
    """Requests from a generated workload; with ``shared_prefix`` > 0, requests of one
    group share that many leading tokens (for prefix-cache hits)."""
    reqs = []
    for i, w in enumerate(workload):
        prompt = None
        if shared_prefix:
            head = [(w["group"] * 17 + k) % 89 + 5 for k in range(shared_prefix)]
            prompt = head + [(i * 7 + k) % 89 + 5 for k in range(w["prompt"])]
        reqs.append(make_req(f"r{i}", w["prompt"], w["max_tokens"], arrival=float(w["arrival"]),
                             prompt=prompt, priority=w["priority"], tenant=w["tenant"],
                             slo_ttft_s=w["ttft"], expected=w["expected"]))
    return reqs


# ---- every policy ------------------------------------------------------------------------
@SETTINGS
@given(workloads, st.sampled_from(ALL), st.integers(4, 48), st.integers(1, 6),
       st.sampled_from([1, 2, 4, 8]), st.booleans(), st.sampled_from([None, 0, 1, 3]),
       st.booleans())
def test_every_policy_keeps_invariants_and_never_changes_tokens(
        workload, policy, budget, max_seqs, block_size, caching, cap, chunked) -> None:
    """Random streams with preemption: caps hold each step, invariants hold, everything
    finishes with the tokens its id and positions dictate (order changes, tokens don't)."""
    sched = sched_for(policy, PolicyConfig(sjf_aging_s=5.0, default_slo_ttft_s=8.0,
                                           lpm_window=4),
                      num_blocks=96 // block_size, block_size=block_size,
                      max_num_seqs=max_seqs,
                      # without chunking a whole prompt must fit one step's budget
                      max_num_batched_tokens=budget if chunked else 8 + 40,
                      enable_prefix_caching=caching, max_preemptions_per_request=cap,
                      enable_chunked_prefill=chunked)
    sim = Sim(sched, build(workload, shared_prefix=8 if caching else 0))
    sim.run()
    assert_exact_outputs(sim)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


# ---- sjf ---------------------------------------------------------------------------------
@SETTINGS
@given(workloads, st.sampled_from([1.0, 3.0, 8.0]), st.integers(1, 4), st.integers(8, 48),
       st.booleans())
def test_sjf_aging_never_lets_a_request_arrived_aging_s_later_go_first(
        workload, aging, max_seqs, budget, small_kv) -> None:
    sched = sched_for("sjf", PolicyConfig(sjf_aging_s=aging), max_num_seqs=max_seqs,
                      max_num_batched_tokens=budget, num_blocks=16 if small_kv else 64)
    sim = Sim(sched, build(workload))
    arrival = {r.request_id: r.arrival_time for r in sim.all.values()}

    def check(sim, out, rec):
        for rid, waiting in waiting_at_each_admission(rec):
            for other in waiting:
                assert arrival[rid] < arrival[other] + aging, (
                    f"{rid} (arrived {arrival[rid]}) admitted ahead of {other} "
                    f"(arrived {arrival[other]}) with aging {aging}")

    sim.after_schedule = check
    sim.run()
    assert_exact_outputs(sim)


@SETTINGS
@given(workloads, st.sampled_from([0.5, 2.0, 8.0]), st.integers(1, 4), st.integers(8, 48),
       st.booleans(), st.booleans())
def test_sjf_overtake_bound_never_passes_an_overdue_request(
        workload, factor, max_seqs, budget, small_kv, caching) -> None:
    """Random arrivals (preemption with a small pool, prefix hits with caching): every
    request finishes with its tokens, and whenever a waiting request is overdue (the
    work admitted since it joined the queue reached ``factor`` times its own), the
    request admitted is overdue too and due no later: nobody passes it any more."""
    sched = sched_for("sjf", PolicyConfig(sjf_overtake_factor=factor),
                      max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                      num_blocks=16 if small_kv else 64, enable_prefix_caching=caching)
    policy = sched.policy
    admit = policy.on_admitted
    passed: list[str] = []

    def on_admitted(request, now):
        due, clock = policy.due_at(request.request_id), policy.work_clock
        for other in policy.waiting():
            other_due = policy.due_at(other.request_id)
            if other_due is not None and other_due <= clock and (
                    due is None or due > other_due):
                passed.append(f"{request.request_id} (due {due}) admitted ahead of overdue "
                              f"{other.request_id} (due {other_due}) at {clock}")
        admit(request, now)

    policy.on_admitted = on_admitted
    sim = Sim(sched, build(workload, shared_prefix=8 if caching else 0))
    sim.run()
    assert not passed, passed[0]
    assert_exact_outputs(sim)


def long_request_vs_stream_of_short_ones(aging: float) -> tuple[Sim, float]:
    """One long request at t=0 and a new short one every step for 80 steps, one slot."""
    sched = sched_for("sjf", PolicyConfig(sjf_aging_s=aging), max_num_seqs=1,
                      max_num_batched_tokens=64, num_blocks=64)
    reqs = [make_req("long", 30, 8)]
    reqs += [make_req(f"s{t}", 2, 1, arrival=float(t)) for t in range(80)]
    sim = Sim(sched, reqs)
    sim.run()
    return sim, sim.steps[sim.admission_step("long")].start


def test_sjf_without_aging_starves_and_aging_bounds_the_wait() -> None:
    _, starved = long_request_vs_stream_of_short_ones(0.0)
    assert starved >= 79, "pure SJF serves every short request first"
    sim, aged = long_request_vs_stream_of_short_ones(10.0)
    # Shorts that arrived at t >= 10 sort behind it: it goes once the slot frees after that.
    assert aged <= 10.0 + 1.0
    assert_exact_outputs(sim)


# ---- priority ----------------------------------------------------------------------------
def inversion_with_room(sim: Sim, out, rec: StepRecord) -> str | None:
    """A description of a priority inversion that preemption could have resolved, or None.

    The most urgent waiting request, and the running requests strictly less urgent
    than it (not admitted this step, not protected by the preemption cap): if removing
    them would give it a slot, at least one token of budget and the KV blocks for that
    chunk, the scheduler should have done so (prefix caching is off here).
    """
    sched = sim.sched
    head = sched.policy.peek(rec.start)
    if head is None or rec.running_preemptions:
        return None  # the running batch itself had to preempt: no admission this step
    cap = sched.config.max_preemptions_per_request
    lower = [r for r in sched.running
             if r.priority > head.priority and r.request_id not in rec.admitted
             and (cap is None or r.num_preemptions < cap)]
    if not lower:
        return None
    budget = (sched.config.max_num_batched_tokens - out.total_num_scheduled_tokens
              + sum(out.num_scheduled_tokens.get(r.request_id, 0) for r in lower))
    tokens = min(head.num_tokens, budget)
    if tokens <= 0 or (tokens < head.num_tokens and not sched.config.enable_chunked_prefill):
        return None
    kv = sched.kv
    free = kv.num_free_blocks + sum(len(kv.req_blocks.get(r.request_id, ())) for r in lower)
    if math.ceil(tokens / kv.block_size) > free:
        return None
    return (f"step {rec.index}: {head.request_id} (priority {head.priority}) waits while "
            f"{[(r.request_id, r.priority) for r in lower]} run")


@SETTINGS
@given(workloads, st.integers(1, 4), st.integers(4, 48), st.sampled_from([8, 12, 24, 64]),
       st.sampled_from([None, 1, 2]))
def test_priority_inversion_never_survives_a_step_with_room(
        workload, max_seqs, budget, num_blocks, cap) -> None:
    sched = sched_for("priority", max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                      num_blocks=num_blocks, max_preemptions_per_request=cap)
    reqs = [r for r in build(workload) if r.num_prompt_tokens + r.max_tokens
            <= num_blocks * 4]
    sim = Sim(sched, reqs)
    problems = []
    sim.after_schedule = lambda s, out, rec: problems.append(inversion_with_room(s, out, rec))
    sim.run()
    assert not [p for p in problems if p], problems
    assert_exact_outputs(sim)


def test_an_urgent_arrival_preempts_the_least_urgent_in_its_first_step() -> None:
    sched = sched_for("priority", max_num_seqs=2, max_num_batched_tokens=64, num_blocks=64)
    reqs = [make_req("low-old", 8, 30, priority=5, arrival=0.0),
            make_req("low-new", 8, 30, priority=5, arrival=0.5),
            make_req("mid", 8, 30, priority=3, arrival=1.0),
            make_req("urgent", 8, 3, priority=0, arrival=4.0)]
    sim = Sim(sched, reqs)
    sim.run()
    step = sim.admission_step("urgent")
    assert sim.steps[step].start == 4.0, "admitted in the step it arrived"
    # low-new and mid join at t=1: mid takes the free slot, low-new (as urgent as the
    # running low-old) waits without preempting it. At t=4 low-old is the least urgent.
    mid_step = sim.steps[sim.admission_step("mid")]
    assert mid_step.start == 1.0 and not mid_step.out.preempted_req_ids
    assert sim.steps[step].out.preempted_req_ids == {"low-old"}
    assert sched.stats.num_admission_preemptions == 1
    assert sim.admission_step("low-new") > step, "low-new only runs after urgent is done"
    assert_exact_outputs(sim)


# ---- fair --------------------------------------------------------------------------------
def fair_bound(cfg: PolicyConfig, tenant: str, longest_prompt: int, most_tokens: int,
               max_seqs: int) -> float:
    """U_x from FairPolicy's docstring."""
    phi = dict(cfg.tenant_weights).get(tenant, 1.0)
    return (cfg.fair_input_weight * longest_prompt
            + cfg.fair_output_weight * max_seqs * most_tokens) / phi


def worst_service_gap(sim: Sim, x: str, y: str) -> float:
    """Largest |service_x - service_y| accrued over any stretch of steps in which both
    tenants had waiting requests throughout."""
    worst, run = 0.0, []
    for rec in [*sim.steps, None]:
        both = rec is not None and {x, y} <= {sim.all[r].tenant for r in rec.waiting}
        if both:
            run.append(rec.service.get(x, 0.0) - rec.service.get(y, 0.0))
        elif run:
            worst = max(worst, max(run) - min(run))
            run = []
    return worst


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ffffgh"), st.integers(1, 24), st.integers(1, 8),
                          st.integers(0, 20)), min_size=2, max_size=60),
       st.integers(1, 4), st.integers(8, 48), st.sampled_from([12, 24, 64]),
       st.sampled_from([(), (("g", 2.0),), (("f", 0.5), ("h", 3.0))]),
       st.sampled_from([(1.0, 2.0), (1.0, 1.0), (0.5, 4.0)]),
       st.sampled_from([None, 0.0, 8.0]), st.sampled_from([0.0, 6.0, 40.0]))
def test_fair_keeps_backlogged_tenants_within_the_stated_bound(
        spec, max_seqs, budget, num_blocks, weights, io_weights, gap, credit) -> None:
    cfg = PolicyConfig(fair_input_weight=io_weights[0], fair_output_weight=io_weights[1],
                       tenant_weights=weights, fair_preempt_gap=gap, fair_rejoin_credit=credit)
    sched = sched_for("fair", cfg, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                      num_blocks=num_blocks)
    reqs = [make_req(f"{t}{i}", p, o, arrival=float(a), tenant=t)
            for i, (t, p, o, a) in enumerate(spec)]
    sim = Sim(sched, reqs, input_weight=cfg.fair_input_weight,
              output_weight=cfg.fair_output_weight, tenant_weights=dict(weights))
    sim.run()
    longest = max(r.num_prompt_tokens for r in reqs)
    most = max(r.max_tokens for r in reqs)
    tenants = sorted({r.tenant for r in reqs})
    for i, x in enumerate(tenants):
        for y in tenants[i + 1:]:
            bound = (fair_bound(cfg, x, longest, most, max_seqs)
                     + fair_bound(cfg, y, longest, most, max_seqs) + 2 * credit)
            assert worst_service_gap(sim, x, y) <= bound + 1e-9, (x, y, bound)
    assert_exact_outputs(sim)


def flood(policy: str) -> Sim:
    """Tenant f sends 40 requests at t=0, tenant g 4 (queued behind them)."""
    sched = sched_for(policy, max_num_seqs=2, max_num_batched_tokens=32, num_blocks=64)
    reqs = [make_req(f"f{i}", 6, 4, tenant="f") for i in range(40)]
    reqs += [make_req(f"g{i}", 6, 4, tenant="g") for i in range(4)]
    sim = Sim(sched, reqs)
    sim.run()
    return sim


def test_fcfs_breaks_the_fair_bound_that_fair_keeps() -> None:
    bound = 2 * fair_bound(PolicyConfig(), "f", 6, 4, 2)  # 2 * (6 + 2 * 2 * 4) = 44
    fcfs, fair = flood("fcfs"), flood("fair")
    assert worst_service_gap(fcfs, "f", "g") > 3 * bound
    assert worst_service_gap(fair, "f", "g") <= bound
    # g alternates with f (2 slots, 4 steps a request) instead of waiting for all of f.
    last_g = max(fair.admission_step(f"g{i}") for i in range(4))
    assert last_g <= 16 and fcfs.admission_step("g0") >= 76


def test_fair_does_not_starve_a_light_tenant_under_a_flood() -> None:
    """f keeps 3 requests arriving every step (far above capacity); g sends one at t=20."""
    def light_wait(policy: str) -> float:
        sched = sched_for(policy, max_num_seqs=2, max_num_batched_tokens=32, num_blocks=64)
        reqs = [make_req(f"f{t}-{k}", 5, 6, tenant="f", arrival=float(t))
                for t in range(60) for k in range(3)]
        reqs.append(make_req("g", 5, 6, tenant="g", arrival=20.0))
        sim = Sim(sched, reqs)
        sim.run(max_steps=2000)
        return sim.steps[sim.admission_step("g")].start - 20.0

    # Under fair g enters the backlog at f's counter: it goes at the next admission but one
    # (f may win the tie once), and a slot frees at least every max_tokens = 6 steps.
    assert light_wait("fair") <= 2 * 6
    assert light_wait("fcfs") > 100


# ---- edf ---------------------------------------------------------------------------------
@SETTINGS
@given(st.integers(1, 3), st.integers(1, 4), st.lists(st.tuples(st.integers(1, 6),
                                                                 st.integers(0, 3)),
                                                      min_size=1, max_size=10),
       st.randoms(use_true_random=False))
def test_edf_meets_every_deadline_of_a_feasible_batch(slots, length, jobs, rnd) -> None:
    """Equal-length jobs released together on ``slots`` slots: the deadline of the job of
    rank r in some order is at least when r would get its first token in that order
    (plus slack), so the set is feasible; EDF must meet every TTFT and TPOT target."""
    ranks = list(range(len(jobs)))
    rnd.shuffle(ranks)
    reqs = []
    for i, ((prompt, slack), rank) in enumerate(zip(jobs, ranks)):
        ttft = (rank // slots) * length + 1 + slack
        reqs.append(make_req(f"j{i}", prompt, length, slo_ttft_s=float(ttft), slo_tpot_s=1.0))
    sched = sched_for("edf", max_num_seqs=slots, max_num_batched_tokens=64, num_blocks=64)
    sim = Sim(sched, reqs)
    sim.run()
    for req in reqs:
        assert req.first_token_time - req.arrival_time <= req.slo_ttft_s, req.request_id
        if req.max_tokens > 1:
            tpot = (req.last_token_time - req.first_token_time) / (req.max_tokens - 1)
            assert tpot <= req.slo_tpot_s
    assert sched.policy.stats()["num_admitted_late"] == 0


def staggered(policy: str) -> dict[str, float]:
    """One slot; A runs; C (lax) arrives before B (tight): FCFS serves C first."""
    sched = sched_for(policy, max_num_seqs=1, max_num_batched_tokens=64, num_blocks=64)
    reqs = [make_req("A", 4, 3, arrival=0.0, slo_ttft_s=10.0, slo_tpot_s=1.0),
            make_req("C", 4, 4, arrival=0.5, slo_ttft_s=20.0, slo_tpot_s=1.0),
            make_req("B", 4, 2, arrival=0.6, slo_ttft_s=4.5, slo_tpot_s=1.0)]
    sim = Sim(sched, reqs)
    sim.run()
    return {r.request_id: r.first_token_time - r.arrival_time - r.slo_ttft_s for r in reqs}


def test_edf_meets_a_staggered_schedule_that_fcfs_misses() -> None:
    assert max(staggered("fcfs").values()) > 0, "FCFS serves C before B: B is late"
    assert max(staggered("edf").values()) <= 0


def test_edf_serves_requests_that_can_still_make_it_before_late_ones() -> None:
    """One slot, busy until t=6. "late" (due 2.5) can no longer make it; "ontime" (due 7.5)
    can, but only if it goes first: plain earliest-deadline order would miss both."""
    sched = sched_for("edf", max_num_seqs=1, max_num_batched_tokens=64, num_blocks=64)
    reqs = [make_req("busy", 4, 6, arrival=0.0),
            make_req("late", 4, 2, arrival=0.5, slo_ttft_s=2.0),
            make_req("ontime", 4, 2, arrival=0.5, slo_ttft_s=7.0)]
    sim = Sim(sched, reqs)
    sim.run()
    assert sim.admission_step("ontime") < sim.admission_step("late")
    assert reqs[2].first_token_time - reqs[2].arrival_time <= 7.0
    assert sched.policy.stats() == {"num_admitted_on_time": 1, "num_admitted_late": 1}


# ---- queue-wait threshold ----------------------------------------------------------------
@SETTINGS
@given(workloads, st.sampled_from(["fcfs", "sjf", "priority", "fair", "lpm"]),
       st.sampled_from([1.0, 2.5, 6.0]), st.integers(1, 3),
       st.sampled_from([12, 64]))
def test_queue_wait_reject_is_honoured_to_within_one_step(
        workload, policy, limit, max_seqs, num_blocks) -> None:
    """Variable step durations; preemptions allowed. A request that never ran is admitted
    before it has waited ``limit`` or rejected within one step after; one that ran is
    never rejected."""
    sched = sched_for(policy, max_num_seqs=max_seqs, max_num_batched_tokens=24,
                      num_blocks=num_blocks, max_queue_wait_s=limit, queue_wait_action="reject")
    reqs = [r for r in build(workload) if r.num_prompt_tokens + r.max_tokens <= num_blocks * 4]
    sim = Sim(sched, reqs, step_time=lambda out: 0.25 + 0.05 * out.total_num_scheduled_tokens)
    sim.run()
    longest_step = max((s.end - s.start for s in sim.steps), default=0.0)
    for rec in sim.steps:
        for rid in rec.rejected:
            req = sim.all[rid]
            waited = rec.start - req.arrival_time
            assert limit <= waited < limit + longest_step, (rid, waited)
            assert req.first_scheduled_time is None
        for rid in rec.admitted:
            req = sim.all[rid]
            if req.first_scheduled_time == rec.start and req.num_preemptions == 0:
                assert rec.start - req.arrival_time < limit, rid
    assert_exact_outputs(sim)
    assert sched.stats.num_wait_rejected == sum(len(s.rejected) for s in sim.steps)


@SETTINGS
@given(workloads, st.sampled_from(ALL), st.sampled_from([1.0, 3.0, 5.0]), st.integers(1, 3),
       st.sampled_from([16, 256]))
def test_overdue_requests_go_first_in_the_order_they_became_overdue(
        workload, policy, limit, max_seqs, num_blocks) -> None:
    """With ``admit``: a request that has waited ``limit`` since it joined the queue (its
    arrival, or its preemption) is admitted before any request that is not overdue, and
    overdue ones in the order they joined."""
    sched = sched_for(policy, PolicyConfig(default_slo_ttft_s=30.0), max_num_seqs=max_seqs,
                      max_num_batched_tokens=24, num_blocks=num_blocks, max_queue_wait_s=limit)
    reqs = [r for r in build(workload) if r.num_prompt_tokens + r.max_tokens <= num_blocks * 4]
    sim = Sim(sched, reqs)
    joined: dict[str, float] = {}  # id -> time it joined the waiting queue

    def check(sim, out, rec):
        for rid in sim.join_order[len(joined):]:
            joined.setdefault(rid, sim.all[rid].arrival_time)
        was_waiting = [r for r in [*rec.admitted, *rec.waiting]
                       if r not in out.preempted_req_ids]
        overdue = {r for r in was_waiting if rec.start - joined[r] >= limit}
        n = len(overdue & set(rec.admitted))
        assert set(rec.admitted[:n]) <= overdue, "overdue requests go first"
        times = [joined[r] for r in rec.admitted[:n]]
        assert times == sorted(times), "overdue requests go in the order they joined"
        left = [joined[r] for r in overdue - set(rec.admitted)]
        assert not left or not times or min(left) >= times[-1], "an older overdue one waits"
        if len(rec.admitted) > n:
            assert not left, "a fresh request went ahead of an overdue one"
        for rid in out.preempted_req_ids:
            joined[rid] = rec.start

    sim.after_schedule = check
    sim.run()
    assert_exact_outputs(sim)


# ---- admission control and the preemption cap --------------------------------------------
@SETTINGS
@given(st.integers(0, 5), st.lists(st.integers(1, 3), min_size=1, max_size=30))
def test_admission_control_bounds_the_waiting_queue(limit, batch_sizes) -> None:
    """Batches of n samples arrive each step; one is refused exactly when n more would
    exceed max_queue_len, so the waiting queue never holds more than that."""
    sched = sched_for("fcfs", max_num_seqs=1, max_queue_len=limit)
    runner = FakeRunner(sched.kv.block_size)
    refused = 0
    for step, n in enumerate(batch_sizes):
        if sched.queue_full(n):
            assert sched.num_waiting + n > limit
            refused += 1
        else:
            for k in range(n):
                sched.add_request(make_req(f"r{step}-{k}", 3, 2, arrival=float(step)),
                                  float(step))
        assert sched.num_waiting <= limit
        out = sched.schedule(float(step))
        sched.update(out, runner.execute(out), float(step))
    if limit < min(batch_sizes):
        assert refused == len(batch_sizes)


def watch_victims(sched) -> dict[str, int]:
    """Check that capped requests are never offered as victims; count self-preemptions."""
    cap = sched.config.max_preemptions_per_request
    policy = sched.policy
    own: dict[str, int] = {}
    select, for_waiting = policy.select_victim, policy.victim_for_waiting

    def checked_select(running, requester):
        assert all(r is requester or r.num_preemptions < cap for r in running)
        victim = select(running, requester)
        if victim is None or victim is requester:
            own[requester.request_id] = own.get(requester.request_id, 0) + 1
        return victim

    def checked_for_waiting(running, candidate):
        assert all(r.num_preemptions < cap for r in running)
        return for_waiting(running, candidate)

    policy.select_victim = checked_select
    policy.victim_for_waiting = checked_for_waiting
    return own


@SETTINGS
@given(workloads, st.sampled_from(ALL), st.sampled_from([0, 1, 2]), st.integers(2, 6))
def test_preemption_cap_protects_requests_from_others(workload, policy, cap, max_seqs) -> None:
    sched = sched_for(policy, max_num_seqs=max_seqs, max_num_batched_tokens=32,
                      num_blocks=14, max_preemptions_per_request=cap)
    sim = Sim(sched, [r for r in build(workload) if r.num_prompt_tokens + r.max_tokens <= 56])
    own = watch_victims(sched)
    sim.run()
    for rid, req in sim.all.items():
        assert req.num_preemptions <= cap + own.get(rid, 0), rid
    assert_exact_outputs(sim)


def test_the_cap_stops_a_thrash_that_happens_without_it() -> None:
    def most_preempted_by_others(cap):
        sched = sched_for("fcfs", max_num_seqs=4, max_num_batched_tokens=64, num_blocks=10,
                          max_preemptions_per_request=cap)
        sim = Sim(sched, [make_req(f"r{i}", 6, 24, arrival=0.0) for i in range(4)])
        own = watch_victims(sched) if cap is not None else {}
        sim.run()
        return max(r.num_preemptions - own.get(r.request_id, 0) for r in sim.all.values())

    assert most_preempted_by_others(None) >= 2
    assert most_preempted_by_others(1) <= 1


# ---- lpm ---------------------------------------------------------------------------------
@SETTINGS
@given(workloads, st.integers(1, 5), st.integers(1, 4), st.sampled_from([2, 4]))
def test_lpm_overtakes_at_most_window_times_and_only_within_the_window(
        workload, window, max_seqs, block_size) -> None:
    sched = sched_for("lpm", PolicyConfig(lpm_window=window), max_num_seqs=max_seqs,
                      max_num_batched_tokens=32, num_blocks=512 // block_size,
                      block_size=block_size, enable_prefix_caching=True)
    sim = Sim(sched, build(workload, shared_prefix=12))
    overtaken: dict[str, int] = {}

    def check(sim, out, rec):
        assert not out.preempted_req_ids  # ample KV: queue order is join order
        for rid, waiting in waiting_at_each_admission(rec):
            pos = sim.join_order.index(rid)
            older = [w for w in waiting if sim.join_order.index(w) < pos]
            assert len(older) < window, f"{rid} was admitted from outside the window"
            for w in older:
                overtaken[w] = overtaken.get(w, 0) + 1
                assert overtaken[w] <= window, f"{w} overtaken more than {window} times"

    sim.after_schedule = check
    sim.run()
    assert_exact_outputs(sim)


def cache_reuse(policy: str) -> Sim:
    """A finished request leaves a 32-token prefix cached; then 4 unrelated requests and
    4 that share the prefix arrive, in that order, into a pool too small for both."""
    sched = sched_for(policy, PolicyConfig(lpm_window=16), max_num_seqs=2,
                      max_num_batched_tokens=64, num_blocks=24, block_size=4,
                      enable_prefix_caching=True)
    prefix = [(3 * k) % 89 + 5 for k in range(32)]
    reqs = [make_req("warm", 32, 1, prompt=prefix)]
    reqs += [make_req(f"x{i}", 40, 4, arrival=2.0) for i in range(4)]
    reqs += [make_req(f"y{i}", 36, 4, arrival=2.0, prompt=prefix + [90 + i] * 4)
             for i in range(4)]
    sim = Sim(sched, reqs)
    sim.run()
    return sim


def test_lpm_uses_cached_prefixes_before_they_are_evicted() -> None:
    fcfs, lpm = cache_reuse("fcfs"), cache_reuse("lpm")
    hits = {name: [s.all[f"y{i}"].num_cached_tokens for i in range(4)]
            for name, s in (("fcfs", fcfs), ("lpm", lpm))}
    assert hits["lpm"] == [32] * 4, hits
    assert sum(hits["fcfs"]) < sum(hits["lpm"]), hits
    assert lpm.sched.policy.stats()["num_reordered"] > 0
    assert_exact_outputs(lpm)


def newcomer_flood(credit: float) -> tuple[Sim, int]:
    """f has been served alone for 40 steps when g floods in; returns the sim and the
    first step after t=40 that admits one of f's requests."""
    cfg = PolicyConfig(fair_rejoin_credit=credit)
    sched = sched_for("fair", cfg, max_num_seqs=2, max_num_batched_tokens=32, num_blocks=64)
    reqs = [make_req(f"f{i}", 6, 4, tenant="f") for i in range(60)]
    reqs += [make_req(f"g{i}", 6, 4, tenant="g", arrival=40.0) for i in range(30)]
    sim = Sim(sched, reqs)
    sim.run()
    f_after = [sim.admission_step(f"f{i}") for i in range(60)
               if sim.steps[sim.admission_step(f"f{i}")].start >= 40.0]
    return sim, min(f_after)


def test_fair_lifts_a_newcomer_so_it_cannot_starve_the_incumbent() -> None:
    """Plain VTC lift: g starts at f's counter, so the two alternate at once instead of g
    taking everything until it catches up. With a rejoin credit g goes first for about
    that much service, and the bound grows by twice the credit, no more."""
    bound = 2 * fair_bound(PolicyConfig(), "f", 6, 4, 2)
    sim, f_next = newcomer_flood(0.0)
    assert worst_service_gap(sim, "f", "g") <= bound
    assert f_next <= 40 + 2 * 4, "f keeps being served after g arrives"
    sim, f_next = newcomer_flood(60.0)
    assert worst_service_gap(sim, "f", "g") <= bound + 2 * 60.0
    # g's requests cost 6 + 2 * 4 = 14 each: the credit of 60 buys it 4 admissions (two
    # rounds of 2 slots, 4 steps each) before f's next one, instead of none.
    assert f_next == 40 + 2 * 4


# ---- fair: admission preemption ------------------------------------------------------------
def light_arrival(gap: float | None, cap: int | None = None) -> Sim:
    """heavy fills both slots with long requests (and keeps 20 more waiting) when the
    light tenant's one request arrives at t=10."""
    sched = sched_for("fair", PolicyConfig(fair_preempt_gap=gap), max_num_seqs=2,
                      max_num_batched_tokens=32, num_blocks=64,
                      max_preemptions_per_request=cap)
    reqs = [make_req(f"h{i}", 6, 30, tenant="heavy") for i in range(22)]
    reqs.append(make_req("light", 6, 4, tenant="light", arrival=10.0))
    sim = Sim(sched, reqs)
    sim.run()
    return sim


def test_fair_preempts_to_admit_a_light_tenant_within_its_first_step() -> None:
    on = light_arrival(0.0)
    step = on.steps[on.admission_step("light")]
    assert step.start == 10.0, "admitted in the step it arrived"
    assert step.admission_preemptions == 1 and step.out.preempted_req_ids == {"h1"}
    assert on.sched.stats.num_admission_preemptions == 1
    assert_exact_outputs(on)
    # Without admission preemption it waits for a heavy request to finish (t=30).
    off = light_arrival(None)
    assert off.steps[off.admission_step("light")].start >= 30.0
    assert off.sched.stats.num_preemptions == 0
    # A gap larger than the light tenant's lead keeps it waiting too.
    wide = light_arrival(1e6)
    assert wide.steps[wide.admission_step("light")].start >= 30.0


def test_fair_admission_preemption_honours_the_preemption_cap() -> None:
    capped = light_arrival(0.0, cap=0)
    assert capped.sched.stats.num_preemptions == 0
    assert capped.steps[capped.admission_step("light")].start >= 30.0
    assert_exact_outputs(capped)


def test_fair_admission_preemption_does_not_ping_pong_between_tenants() -> None:
    """Two tenants flood the same requests: their counters cross back and forth all the
    time, but a swap must leave the victim's tenant no fewer slots than the candidate's,
    so neither preempts the other more than to even out the slots once."""
    sched = sched_for("fair", PolicyConfig(fair_preempt_gap=0.0), max_num_seqs=4,
                      max_num_batched_tokens=64, num_blocks=128)
    reqs = [make_req(f"{t}{i}", 6, 8, tenant=t, arrival=0.5 * i) for t in "fg"
            for i in range(30)]
    reqs += [make_req(f"f-early{i}", 6, 8, tenant="f") for i in range(4)]
    sim = Sim(sched, reqs)
    sim.run()
    assert sched.stats.num_admission_preemptions <= 2
    assert worst_service_gap(sim, "f", "g") <= (2 * fair_bound(PolicyConfig(), "f", 6, 8, 4)
                                                + 2 * PolicyConfig().fair_rejoin_credit)
    assert_exact_outputs(sim)


def test_lpm_bounds_how_often_a_cold_request_is_overtaken() -> None:
    """A request with no cached prefix, then a stream of requests that hit the cache:
    with a window of 2 the cold one goes after at most 2 of them."""
    sched = sched_for("lpm", PolicyConfig(lpm_window=2), max_num_seqs=1,
                      max_num_batched_tokens=64, num_blocks=64, block_size=4,
                      enable_prefix_caching=True)
    prefix = [(5 * k) % 89 + 5 for k in range(16)]
    reqs = [make_req("warm", 16, 1, prompt=prefix), make_req("cold", 16, 2, arrival=1.0)]
    reqs += [make_req(f"hot{t}", 20, 2, arrival=1.0 + t, prompt=prefix + [90 + t % 7] * 4)
             for t in range(12)]
    sim = Sim(sched, reqs)
    sim.run()
    hot_before = [r for r in sim.all if r.startswith("hot")
                  and sim.admission_step(r) < sim.admission_step("cold")]
    assert len(hot_before) == 2
    assert sched.policy.stats()["num_forced"] == 1


def test_a_preempted_request_past_the_wait_limit_is_promoted_not_rejected() -> None:
    """r1 is preempted after it streamed tokens and then waits longer than the limit for
    r0 to finish: it has output already, so it is promoted, never rejected."""
    sched = sched_for("fcfs", max_num_seqs=2, max_num_batched_tokens=32, num_blocks=6,
                      block_size=4, max_queue_wait_s=3.0, queue_wait_action="reject")
    sim = Sim(sched, [make_req("r0", 4, 16), make_req("r1", 4, 16)])
    sim.run()
    assert sim.all["r1"].num_preemptions >= 1
    assert sched.stats.num_wait_rejected == 0 and sched.stats.num_overdue >= 1
    assert_exact_outputs(sim)
