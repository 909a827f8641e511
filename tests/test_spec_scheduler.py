"""Speculative decoding in the scheduler, without a model: draft lengths, rollback,
blocks, and the simulator's accepted-length model (all in virtual time)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sim_helpers import LinearCost, tiny_args

from conveyor.bench.workload import BenchRequest
from conveyor.config import SpeculativeConfig, resolve_engine_config
from conveyor.core.scheduler import Scheduler
from conveyor.costs.shape import BatchShape
from conveyor.engine.core import EngineCore
from conveyor.engine.messages import EngineCoreRequest
from conveyor.executor.cost_model import CostModelExecutor
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams
from conveyor.sim import Simulator
from conveyor.sim.model import resolve_sim_model
from conveyor.spec.acceptance import PriorWeight
from conveyor.spec.planner import DraftLengthController, DraftRow
from conveyor.spec.step_cost_fit import OnlineStepCost


def spec(rate: float, k: int = 4, adaptive: bool = True, method: str = "synthetic") -> dict:
    return {"method": method, "num_speculative_tokens": k, "acceptance_rate": rate,
            "adaptive": adaptive}


def work(n: int, gap: float, out_len: int = 40, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(f"r{i}", i * gap, [rng.randrange(4, 500) for _ in range(24)],
                         out_len) for i in range(n)]


def sim(work_items, speculative=None, cost=None, **kw):
    args = tiny_args(num_kv_blocks=2048, max_num_seqs=64, max_num_batched_tokens=512,
                     speculative_config=speculative, **kw)
    return Simulator(args, cost or LinearCost()).run(work_items)


# ---- the simulator learns speculation --------------------------------------------------
def test_every_draft_accepted_gives_k_plus_one_tokens_per_step():
    k, new = 3, 21
    res = sim([BenchRequest("a", 0.0, list(range(10, 30)), new)], spec(1.0, k, False))
    # One step for the prompt (and first token), then k + 1 tokens per step.
    assert res.num_steps == 1 + -(-(new - 1) // (k + 1))
    assert res.finished["a"].num_generation_tokens == new


def test_no_draft_accepted_changes_nothing_but_the_step_sizes():
    base = sim(work(4, 0.0))
    none = sim(work(4, 0.0), spec(0.0, 3, False))
    assert none.num_steps == base.num_steps
    assert {r: m.num_generation_tokens for r, m in none.finished.items()} == \
        {r: m.num_generation_tokens for r, m in base.finished.items()}


def _gen_time(res) -> float:
    return max(m.finished_time for m in res.finished.values())


@pytest.mark.parametrize("rate", [0.3, 0.6, 0.9])
def test_adaptive_k_never_loses_and_pays_where_a_step_is_fixed_cost(rate):
    """A memory-bound step (fixed cost dominates): speculation pays at batch 1. A
    compute-bound one at batch 64: every token costs its share, so verifying drafts
    that may fail loses; the adaptive k falls to (nearly) 0 there, fixed k does not."""
    memory_bound = LinearCost(per_step=0.02, per_token=0.0002)
    compute_bound = LinearCost(per_step=0.001, per_token=0.001)
    lone = work(1, 0.0, out_len=200)
    crowd = work(64, 0.0, out_len=60)
    for cost, items in ((memory_bound, lone), (compute_bound, crowd)):
        off = _gen_time(sim(items, cost=cost))
        adaptive = sim(items, spec(rate), cost=cost)
        assert _gen_time(adaptive) <= off * 1.03, (cost.describe(), rate)
    # At batch 1 on the memory-bound step: a real gain that grows with the rate.
    gain = off_lone = _gen_time(sim(lone, cost=memory_bound))
    gain = off_lone / _gen_time(sim(lone, spec(rate), cost=memory_bound))
    expected = sum(rate ** j for j in range(5))  # E[tokens per step], k = 4
    assert gain > 0.8 * expected
    # Saturated and compute-bound: fixed k loses where adaptive does not.
    off = _gen_time(sim(crowd, cost=compute_bound))
    fixed = _gen_time(sim(crowd, spec(rate, adaptive=False), cost=compute_bound))
    if rate <= 0.6:
        assert fixed > off * 1.05


# ---- the controller --------------------------------------------------------------------
class FixedCost:
    def __init__(self, a: float, b: float) -> None:
        self.a, self.b = a, b

    def step_time(self, shape: BatchShape) -> float:  # a StepCostModel
        return self.a + self.b * shape.num_tokens


def _rows(n: int, drafts: int = 4, cap: int = 4) -> list[DraftRow]:
    rows = []
    for i in range(n):
        req = Request(f"r{i}", [1, 2, 3], SamplingParams(), 0.0, max_tokens=100)
        req.spec_token_ids = [7] * drafts
        rows.append(DraftRow(req, cap))
    return rows


def test_draft_length_falls_with_load_and_rises_with_acceptance():
    cfg = SpeculativeConfig("ngram", num_speculative_tokens=4)
    ctl = DraftLengthController(cfg, FixedCost(a=0.05, b=0.001))
    lone = _rows(1)
    ctl.plan(lone, 0, 1, 1, 512)
    assert lone[0].k_now == 4  # batch 1: a step is mostly fixed cost
    crowd = _rows(64)
    ctl.plan(crowd, 0, 64, 64, 512)
    assert sum(r.k_now for r in crowd) == 0  # saturated: no slot pays at the 0.5 prior
    for _ in range(30):  # a request whose drafts always survive earns them back
        ctl.observe(crowd[0].request, 4, 4)
    for row in crowd[1:]:  # (and the others' own failures keep theirs off)
        for _ in range(3):
            ctl.observe(row.request, 4, 0)
    ctl.plan(crowd, 0, 64, 64, 512)
    assert crowd[0].k_now == 4 and sum(r.k_now for r in crowd[1:]) == 0



@pytest.mark.parametrize("rate, drafts", [(0.55, False), (0.65, True)])
def test_a_slot_must_pay_its_cost_with_a_margin(rate, drafts):
    """A draft worth 1.1x its marginal cost (acceptance 0.55, a step of 2 ms whose one
    more row costs 1 ms) is not taken; one worth 1.3x (0.65) is."""
    cfg = SpeculativeConfig("ngram", num_speculative_tokens=1)
    ctl = DraftLengthController(cfg, FixedCost(a=0.001, b=0.001))
    for i in range(400):
        ctl.observe(_rows(1)[0].request, 1, int(i % 20 < rate * 20))
    assert ctl.prior()[0] == pytest.approx(rate, abs=0.02)
    rows = _rows(1)
    ctl.plan(rows, 0, 1, 1, 512)
    assert (rows[0].k_want > 0) == drafts

def test_budget_and_drafts_on_hand_bound_the_draft_length():
    cfg = SpeculativeConfig("ngram", num_speculative_tokens=4, adaptive=False)
    ctl = DraftLengthController(cfg, None)
    rows = _rows(3, drafts=2) + _rows(2, drafts=4, cap=1)
    ctl.plan(rows, 0, 5, 5, budget=5)
    assert [r.k_now for r in rows][:3] == [2, 2, 1] or sum(r.k_now for r in rows) == 5
    assert all(r.k_now <= min(len(r.request.spec_token_ids), r.cap) for r in rows)
    assert sum(r.k_now for r in rows) == 5



def _finished_requests(rates: list[float], tries: int, seed: int = 0) -> PriorWeight:
    rng = random.Random(seed)
    weight = PriorWeight()
    for rate in rates:
        weight.observe(sum(rng.random() < rate for _ in range(tries)), tries)
    return weight


def test_the_prior_weighs_by_how_much_requests_differ():
    """Beta-binomial moments over finished requests: alike ones (every rate 0.7) give the
    proposer-wide estimate a large weight; different ones (0.1 or 0.9) a small one; too
    few requests, or too few tries each, leave it at LOW."""
    alike = _finished_requests([0.7] * 60, 20)
    different = _finished_requests([0.1, 0.9] * 30, 20)
    assert alike.weight >= 30 and different.weight == PriorWeight.LOW
    assert _finished_requests([0.7] * (PriorWeight.MIN_REQUESTS - 1), 20).weight \
        == PriorWeight.LOW
    assert _finished_requests([0.7] * 60, PriorWeight.MIN_TRIES - 1).weight == PriorWeight.LOW
    spread = _finished_requests([0.3, 0.5, 0.7, 0.9] * 15, 40)  # a beta of weight ~5
    assert PriorWeight.LOW < spread.weight < 15


def test_an_untried_position_leans_on_the_one_before_it():
    """Drafts 1-3 always accepted, draft 4 never verified (no request drafted 4): its
    estimate is the third's, not 1 in 2, and k = 4 pays where a fourth slot that
    survives under ~0.73 of the time would not (step 1 ms + 0.5 ms a row)."""
    cfg = SpeculativeConfig("ngram", num_speculative_tokens=4)
    ctl = DraftLengthController(cfg, FixedCost(a=0.001, b=0.0005))
    for _ in range(200):
        ctl.observe(_rows(1)[0].request, 3, 3)
    prior = ctl.prior()
    assert prior[0] > 0.95 and prior[3] == pytest.approx(prior[2])
    rows = _rows(1)
    ctl.plan(rows, 0, 1, 1, 512)
    assert rows[0].k_want == 4
    ctl.observe(_rows(1)[0].request, 4, 3)  # now draft 4 is tried: its own count moves it
    assert ctl.prior()[3] < 0.6


def test_one_rejection_does_not_stop_drafts_where_requests_are_alike():
    """Where finished requests accepted draft 1 alike, a request's one rejection moves its
    estimate a little and its drafts go on; where they differed, its own record decides
    and one rejection stops them."""
    for rates, drafts_after in (([0.8] * 40, True), ([0.05, 1.0] * 20, False)):
        ctl = DraftLengthController(SpeculativeConfig("ngram", num_speculative_tokens=1),
                                    FixedCost(a=0.001, b=0.0015))  # pays above 0.6
        ctl.prior_weight = _finished_requests(rates, 20)
        for i in range(200):  # the proposer-wide estimate: 0.8
            ctl.observe(_rows(1)[0].request, 1, int(i % 5 != 0))
        rows = _rows(1)
        ctl.observe(rows[0].request, 1, 0)  # this request's first draft was rejected
        ctl.plan(rows, 0, 1, 1, 512)
        assert (rows[0].k_want > 0) == drafts_after, rates[:2]


def test_finished_requests_feed_the_prior_weight():
    """The scheduler hands every request that leaves to the controller: its draft-1
    record (verifications, accepted) counts in the prior's weight."""
    core, now = _core(0, 64, 2, 0.7, False, "synthetic")
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    for i in range(PriorWeight.MIN_REQUESTS):
        core.add_request(EngineCoreRequest(f"r{i}", [5 + i] * 6, params, arrival_time=0.0))
    while core.scheduler.has_unfinished():
        out = core.schedule()
        core.update(out, core.executor.execute_model(out))
        now[0] += 0.01
    weight = core.scheduler.speculation.controller.prior_weight
    assert weight._count == PriorWeight.MIN_REQUESTS and weight.weight > PriorWeight.LOW

def test_acceptance_is_counted_up_to_the_first_rejection():
    cfg = SpeculativeConfig("ngram", num_speculative_tokens=4)
    ctl = DraftLengthController(cfg, None)
    req = _rows(1)[0].request
    ctl.observe(req, 4, 1)  # draft 1 accepted, draft 2 rejected, 3 and 4 never judged
    m = ctl.metrics.as_dict()
    assert m["accepted_per_position"] == [1, 0, 0, 0]
    assert m["num_draft_tokens"] == 4 and m["num_accepted_tokens"] == 1
    assert m["mean_acceptance_length"] == 2.0
    tried = [t for _, t in req.spec_acceptance]
    assert tried == [1.0, 1.0, 0.0, 0.0]


def test_draft_cost_is_priced_at_the_batch_size_it_runs_at():
    """A roofline-shaped step (flat until 8 rows, linear after): a fit over every size
    would price a batch-32 draft at batch 1's slope; the per-size fit does not."""
    from conveyor.spec.step_cost_fit import BatchStepCost

    def step(d):
        return 0.02 + 0.002 * max(d - 8, 0)

    cost = BatchStepCost()
    for d in (1, 2, 3, 5):
        cost.observe(0, d, step(d), batch=1)
    for d in (32, 40, 64, 96):
        cost.observe(0, d, step(d), batch=32)
    slope_32 = cost.step_s(0, 33, 32) - cost.step_s(0, 32, 32)
    assert slope_32 == pytest.approx(0.002, rel=1e-3)
    assert cost.step_s(0, 2, 1) - cost.step_s(0, 1, 1) == pytest.approx(0.0, abs=1e-6)
    assert cost.step_s(0, 16, 16) is not None  # an unseen size: the overall fit answers


def test_online_step_cost_recovers_prefill_and_decode_costs():
    fit = OnlineStepCost()
    assert fit.step_s(0, 10) is None
    for p, d in [(0, 1), (0, 5), (512, 9), (100, 2), (0, 33), (1024, 64), (7, 17)] * 3:
        fit.observe(p, d, 0.004 + 0.0001 * p + 0.0005 * d)
    a, bp, bd = fit.coefficients()
    assert a == pytest.approx(0.004, rel=1e-3) and bp == pytest.approx(0.0001, rel=1e-3)
    assert bd == pytest.approx(0.0005, rel=1e-3)
    only_decode = OnlineStepCost()  # no prefill in sight: the decode slope still fits
    for d in [1, 4, 9, 16] * 3:
        only_decode.observe(0, d, 0.002 + 0.0003 * d)
    a, _, bd = only_decode.coefficients()
    assert a == pytest.approx(0.002, rel=1e-3) and bd == pytest.approx(0.0003, rel=1e-3)


def test_what_a_proposal_costs_the_next_step_is_not_put_on_the_decode_rows():
    """Batch 1: steps without drafts mostly follow no proposal (3 ms); steps with drafts
    all follow one, which costs the forward 0.5 ms more, and each draft row 0.2 ms. The
    fit tells the two apart (one row's price stays 0.2 ms, not ~0.5), and where every
    step follows a proposal (a fixed k) the term is not known: 0, the intercept holds it."""
    def step(rows: int, after: bool) -> float:
        return 0.003 + 0.0002 * (rows - 1) + 0.0005 * after

    fit, fixed = OnlineStepCost(), OnlineStepCost()
    for rows, after in [(1, False)] * 6 + [(2, True), (3, True), (5, True), (1, True)] * 3:
        fit.observe(0, rows, step(rows, after), after)
    for rows in [5, 5, 5, 3, 5, 2] * 3:
        fixed.observe(0, rows, step(rows, True), True)
    assert fit.coefficients()[2] == pytest.approx(0.0002, rel=1e-3)
    assert fit.after_proposal_s() == pytest.approx(0.0005, rel=1e-3)
    assert fit.step_s(0, 1) == pytest.approx(0.003, rel=1e-3)  # no drafts: no proposal
    assert fixed.after_proposal_s() == 0.0
    plan = DraftLengthController(SpeculativeConfig("ngram", num_speculative_tokens=4), fit)
    rows = _rows(1)
    plan.plan(rows, 0, 1, 1, 512)  # (a bare fit as the plan's cost: it takes the term)
    assert rows[0].k_want > 0
    assert fixed.coefficients()[2] == pytest.approx(0.0002, rel=1e-3)



@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([(0, 1), (0, 4), (0, 5), (64, 4), (512, 9)]),
                          st.integers(1, 40), st.floats(0.5, 2.0), st.integers(0, 50),
                          st.booleans()),
                min_size=2, max_size=12))
def test_online_step_cost_folds_repeated_steps_exactly(runs):
    """Steps of one shape in a row are folded into the fit at once: its normal equations
    equal the decayed sums over every step taken one by one, whatever the runs and
    wherever the fit is read (a read folds the run so far; the run goes on after it)."""
    fit = OnlineStepCost()
    steps = []
    for (p, d), n, noise, read_at, after in runs:
        for i in range(n):
            t = (0.004 + 0.0001 * p + 0.0005 * d) * (noise if i % 2 else 1.0)
            fit.observe(p, d, t, after)
            steps.append((p, d, t, after))
            if i == read_at:
                fit._since_solve = fit.RESOLVE_EVERY  # solve now, whatever the cache
                fit.coefficients()
    fit._fold()
    m = [[0.0] * 4 for _ in range(4)]
    v = [0.0] * 4
    w = 1.0
    for p, d, t, after in reversed(steps):  # the latest step weighs 1, each older one d more
        x = (1.0, p, d, float(after))
        for i in range(4):
            v[i] += w * x[i] * t
            for j in range(4):
                m[i][j] += w * x[i] * x[j]
        w *= fit.decay
    for i in range(4):
        assert fit._v[i] == pytest.approx(v[i], rel=1e-9, abs=1e-12)
        for j in range(4):
            assert fit._m[i][j] == pytest.approx(m[i][j], rel=1e-9, abs=1e-12)

# ---- invariants under rejection, abort and preemption ----------------------------------
def _core(seed: int, num_blocks: int, k: int, rate: float, adaptive: bool, method: str):
    cfg = {**spec(rate, k, adaptive, method), "seed": seed}
    if method == "draft_model":  # simulated: the scheduler reserves its lookahead slots
        cfg["model"] = "unused-in-simulation"
    args = tiny_args(num_kv_blocks=num_blocks, block_size=4, max_num_seqs=6,
                     max_num_batched_tokens=24, speculative_config=cfg)
    model = resolve_sim_model(args)
    config = resolve_engine_config(args, model, num_blocks, "simulated")
    now = [0.0]
    executor = CostModelExecutor(LinearCost(), config.model,
                                 speculative=config.scheduler.speculative)
    return EngineCore(config, executor, clock=lambda: now[0]), now


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(12, 40), k=st.integers(1, 5),
       rate=st.sampled_from([0.0, 0.4, 0.8, 1.0]), adaptive=st.booleans(),
       method=st.sampled_from(["synthetic", "draft_model"]),
       abort_p=st.sampled_from([0.0, 0.05]))
def test_blocks_and_counters_stay_consistent(seed, num_blocks, k, rate, adaptive, method,
                                             abort_p):
    rng = random.Random(seed)
    core, now = _core(seed, num_blocks, k, rate, adaptive, method)
    max_len = core.max_model_len
    max_tokens = {}
    for i in range(10):
        rid = f"r{i}"
        prompt = [rng.randrange(4, 200) for _ in range(rng.randint(1, 30))]
        max_tokens[rid] = rng.randint(1, 30)
        core.add_request(EngineCoreRequest(
            rid, prompt,
            SamplingParams(max_tokens=max_tokens[rid], ignore_eos=True, temperature=0.0),
            arrival_time=0.0))
        max_tokens[rid] = min(max_tokens[rid], max_len - len(prompt))  # what it can get
    produced = {rid: 0 for rid in max_tokens}
    aborted = set()
    budget = core.config.scheduler.max_num_batched_tokens
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        sched_out = core.schedule()
        assert sched_out.total_num_scheduled_tokens <= budget
        for rid, drafts in sched_out.scheduled_spec_tokens.items():
            assert 1 <= len(drafts) <= k
            assert sched_out.num_scheduled_tokens[rid] == 1 + len(drafts)
        run_out = core.executor.execute_model(sched_out)
        now[0] += 0.01
        for out in core.update(sched_out, run_out).outputs:
            produced[out.request_id] += len(out.new_token_ids)
        if abort_p and rng.random() < abort_p * 3:
            victim = rng.choice(sorted(max_tokens))
            core.abort_requests([victim])
            aborted.add(victim)
        core.scheduler.check_invariants()
        for req in core.scheduler.running:
            # Rolled back: everything but (at most) the last token has K/V, no draft does.
            assert req.num_computed_tokens <= req.num_tokens
            assert len(req.output_token_ids) <= req.max_tokens
    assert not core.has_unfinished_requests()
    for rid, n in produced.items():
        assert n <= max_tokens[rid]
        if rid not in aborted:
            assert n == max_tokens[rid]
    assert core.kv.pool.num_used_blocks == 0
    assert core.kv.num_free_blocks == num_blocks


def test_a_guard_switch_off_voids_the_drafts_on_hand():
    """The step after the outcome guard switches a batch size off builds no draft rows;
    the proposals made in the step before are dropped, not kept for a later step (where
    they would be drafts for positions long past)."""
    core, now = _core(0, 64, 3, 1.0, False, "synthetic")
    for i in range(3):
        core.add_request(EngineCoreRequest(
            f"r{i}", [5 + i] * 6, SamplingParams(max_tokens=40, ignore_eos=True,
                                                temperature=0.0), arrival_time=0.0))
    for _ in range(3):  # the prompts, then steps that verify and propose (fixed k)
        out = core.schedule()
        core.update(out, core.executor.execute_model(out))
        now[0] += 0.01
    held = [r for r in core.scheduler.running if r.spec_token_ids]
    assert held, "the harness should leave proposals on hand"
    # Now adaptive, with the guard's verdict against drafts at every size.
    spec_ctl = core.scheduler.speculation.controller
    spec_ctl.config = SpeculativeConfig("synthetic", num_speculative_tokens=3,
                                        acceptance_rate=1.0, adaptive=True)
    spec_ctl.guard.allows = lambda batch: False
    before = spec_ctl.metrics.num_guard_off_steps
    out = core.schedule()
    assert not out.scheduled_spec_tokens and not out.num_spec_wanted
    assert not any(r.spec_token_ids for r in core.scheduler.running)
    assert spec_ctl.metrics.num_guard_off_steps == before + 1


def test_a_prompt_that_ends_proposes_what_its_next_batch_size_drafts():
    """The scheduler asks a request whose prompt ends for the drafts of the last plan at
    the batch size it joins: none where that size's plan drafted nothing, though the
    last plan of all (at another size) drafted."""
    core, now = _core(0, 64, 3, 1.0, True, "synthetic")
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)
    for i in range(3):
        core.add_request(EngineCoreRequest(f"r{i}", [5 + i] * 6, params, arrival_time=0.0))
    for _ in range(2):
        out = core.schedule()
        core.update(out, core.executor.execute_model(out))
        now[0] += 0.01
    spec_ctl = core.scheduler.speculation.controller
    spec_ctl.dormant = lambda batch: True  # the running ones draft nothing this step
    spec_ctl._set_k_want(4, 0)  # batch 4 (bucket 4-7) drafted nothing,
    spec_ctl._set_k_want(1, 3)  # batch 1 drafted 3 last
    core.add_request(EngineCoreRequest("new", [9] * 6, params, arrival_time=0.0))
    out = core.schedule()
    assert "new" in out.sampling_req_ids and len(out.sampling_req_ids) == 4
    assert "new" not in out.num_spec_wanted
    spec_ctl._set_k_want(4, 2)
    core.update(out, core.executor.execute_model(out))
    core.add_request(EngineCoreRequest("new2", [8] * 6, params, arrival_time=0.0))
    out = core.schedule()
    assert out.num_spec_wanted.get("new2") == 2

def test_a_proposal_that_caught_up_is_left_out_of_the_price_of_a_draft():
    """A draft model's proposal that also caught up (a prompt, the text of a pause) took
    time a steady one does not: the proposal-cost fit sees only the steady ones."""
    core, now = _core(0, 64, 3, 1.0, False, "synthetic")
    for i in range(2):
        core.add_request(EngineCoreRequest(
            f"r{i}", [5 + i] * 6, SamplingParams(max_tokens=40, ignore_eos=True,
                                                temperature=0.0), arrival_time=0.0))
    fit = core.scheduler.speculation.controller.proposal_cost
    seen = []
    for step in range(8):
        out = core.schedule()
        run = core.executor.execute_model(out)
        steady = step % 2 == 1
        run.propose_s, run.propose_steady = (0.001 if steady else 0.05), steady
        now[0] += 0.01
        core.update(out, run)
        if out.num_spec_wanted:
            seen.append(steady)
    assert True in seen and False in seen
    assert [s for _, _, s in fit._recent] == [0.001] * seen.count(True)


def _core_watching_the_fit(max_tokens: int):
    """A one-request synthetic core, and what its scheduler fits (each step's rows) and
    hands the outcome guard (each step's steady flag)."""
    core, now = _core(0, 64, 3, 1.0, True, "synthetic")
    core.add_request(EngineCoreRequest(
        "r0", [5] * 6, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                      temperature=0.0), arrival_time=0.0))
    sched = core.scheduler
    fitted, compared = [], []
    observe_fit = sched.speculation.fit.observe
    sched.speculation.fit.observe = lambda p, d, s, *a: (fitted.append(p + d),
                                                         observe_fit(p, d, s, *a))
    observe_step = sched.speculation.controller.observe_step
    sched.speculation.controller.observe_step = lambda *a: (compared.append(a[-1]),
                                                            observe_step(*a))
    return core, now, fitted, compared


def test_a_drafted_step_of_a_new_row_count_is_left_out_of_the_fit_and_the_guard():
    """The first step of a row count pays one-time work (a oneDNN primitive per row
    count): a drafted one is not fitted nor compared; one without drafts is (a prompt's
    step teaches the fit its second size), and so is every later step of that count."""
    core, now, fitted, compared = _core_watching_the_fit(30)
    steps = []
    while core.has_unfinished_requests():
        out = core.schedule()
        run = core.executor.execute_model(out)
        now[0] += 0.01
        core.update(out, run)
        drafts = sum(map(len, out.scheduled_spec_tokens.values()))
        steps.append((out.total_num_scheduled_tokens, drafts))
    seen, want_fitted, want_steady = set(), [], []
    for rows, drafts in steps:
        steady = not drafts or rows in seen
        seen.add(rows)
        want_steady.append(steady)
        if steady:
            want_fitted.append(rows)
    assert any(d for _, d in steps) and False in want_steady  # both kinds ran
    assert fitted == want_fitted and compared == want_steady


def test_a_drafted_step_right_after_a_catch_up_is_left_out_of_the_fit_and_the_guard():
    """A step that verifies drafts right after a proposal that caught up (a draft
    model's prefill of a prompt or of a pause's text evicted the target's weights) runs
    slow for a reason a steady step does not have: it is not fitted nor compared; the
    same row count after a steady proposal is."""
    core, now, fitted, compared = _core_watching_the_fit(40)
    steps: list[tuple[int, int, bool]] = []  # (rows, drafts, its proposal steady)
    while core.has_unfinished_requests():
        out = core.schedule()
        run = core.executor.execute_model(out)
        steady = len(steps) % 3 != 0  # every third step's proposal caught up
        run.propose_steady = steady
        steps.append((out.total_num_scheduled_tokens,
                      sum(map(len, out.scheduled_spec_tokens.values())),
                      steady or not out.num_spec_wanted))
        now[0] += 0.01
        core.update(out, run)
    seen, want_fitted, want_steady, after_steady = set(), [], [], True
    left_out_for_it = 0  # drafted, a row count seen before, after a catch-up
    for rows, drafts, proposal_steady in steps:
        ok = not drafts or (rows in seen and after_steady)
        left_out_for_it += bool(drafts and rows in seen and not after_steady)
        seen.add(rows)
        after_steady = proposal_steady
        want_steady.append(ok)
        if ok:
            want_fitted.append(rows)
    assert left_out_for_it >= 3 and any(d for _, d, _ in steps[1:] if d)
    assert fitted == want_fitted and compared == want_steady


def test_a_requests_own_record_fades_with_the_tokens_it_emits_without_drafts():
    """Three rejections at draft 1 put a request's own estimate far below the
    proposer-wide one; the tokens it then emits without verifying drafts fade that
    record back toward the prior (what failed a stretch of text ago says less now),
    and the next verification starts from the faded counts."""
    cfg = SpeculativeConfig("ngram", num_speculative_tokens=4)
    ctl = DraftLengthController(cfg, FixedCost(a=0.05, b=0.001))
    ctl._glob_acc, ctl._glob_try = [90.0] * 4, [100.0] * 4  # the prior: 0.9
    req = Request("r", [1, 2, 3], SamplingParams(), 0.0, max_tokens=500)
    for _ in range(3):
        ctl.observe(req, 4, 0)
        req.append_output_token(7)  # the step's one token (the scheduler appends it)
    prior = ctl.prior()[0]
    low = ctl.acceptance(req)[0]
    assert low < 0.5 * prior
    assert ctl.acceptance(req)[0] == low  # no tokens since: nothing faded
    for _ in range(10):
        req.append_output_token(7)
    mid = ctl.acceptance(req)[0]
    assert low < mid < prior
    for _ in range(60):
        req.append_output_token(7)
    assert ctl.acceptance(req)[0] == pytest.approx(prior, abs=0.01)
    tried = req.spec_acceptance[0][1]
    ctl.observe(req, 4, 4)
    assert req.spec_acceptance[0][1] == pytest.approx(tried * 0.9 ** 70 * 0.9 + 1.0)


def test_scheduler_without_speculation_has_no_controller():
    from helpers import make_scheduler

    sched: Scheduler = make_scheduler()
    assert sched.speculation is None


def test_proposal_cost_is_fitted_and_weighed():
    from conveyor.spec.proposal_cost import ProposalCost

    fit = ProposalCost()
    assert fit.coefficients() == (0.0, 0.0, 0.0)  # not measured yet: proposing looks free
    fit.observe(1, 1, 0.5)  # a first proposal's one-time work: left out
    for rounds, tokens in [(4, 4), (4, 64), (2, 30), (3, 12), (1, 2), (2, 9), (4, 40)]:
        fit.observe(rounds, tokens, 0.003 + 0.002 * rounds + 0.0001 * tokens)
    c, a, b = fit.coefficients()
    assert c == pytest.approx(0.003, rel=1e-6) and a == pytest.approx(0.002, rel=1e-6)
    assert b == pytest.approx(0.0001, rel=1e-6)
    # Without a cost per call the fit finds none.
    fit = ProposalCost()
    for rounds, tokens in [(4, 4), (4, 64), (2, 30), (3, 12), (1, 2), (2, 9), (4, 40)]:
        fit.observe(rounds, tokens, 0.002 * rounds + 0.0001 * tokens)
    c, a, b = fit.coefficients()
    assert c == pytest.approx(0.0, abs=1e-9) and a == pytest.approx(0.002, rel=1e-6)
    cfg = SpeculativeConfig("draft_model", model="x", num_speculative_tokens=4)
    cheap = DraftLengthController(cfg, FixedCost(a=0.005, b=0.0001))
    rows = _rows(1)
    cheap.plan(rows, 0, 1, 1, 512)
    assert rows[0].k_want == 4
    # A draft forward that costs as much as the target's step: no draft pays at batch 1.
    dear = DraftLengthController(cfg, FixedCost(a=0.005, b=0.0001))
    for k in (1, 2, 3, 4):
        dear.observe_proposals({"r0": k, "r1": 1}, 0.005 * k + 0.0001 * (k + 1))
    rows = _rows(1)
    dear.plan(rows, 0, 1, 1, 512)
    assert rows[0].k_want == 0


def test_one_batch_size_fits_a_cost_per_call_and_per_draft():
    """At batch 1 rounds and tokens move together: the fit is a cost per proposal and
    one per draft (from proposals of two lengths), or all per draft from one length."""
    from conveyor.spec.proposal_cost import ProposalCost

    fit = ProposalCost()
    for k in (2, 2, 3, 2, 2, 3, 2):
        fit.observe(k, k, 0.0006 + 0.0002 * k)
    c, a, b = fit.coefficients()
    assert c == pytest.approx(0.0006, rel=1e-6) and a + b == pytest.approx(0.0002, rel=1e-6)
    one = ProposalCost()
    for _ in range(6):
        one.observe(2, 2, 0.001)
    assert one.coefficients() == (0.0, 0.0, pytest.approx(0.0005))


def test_a_window_of_one_length_keeps_the_last_split():
    """Once proposals of several lengths showed a cost per call, a window of one length
    (the plan settled on k = 1) keeps that split at the window's level: a longer proposal
    is priced as the call plus its drafts, not as k times the one-draft proposal."""
    from conveyor.spec.proposal_cost import ProposalCost

    fit = ProposalCost()
    for k in (1, 2, 3, 4) * 2:
        fit.observe(k, k, 0.001 + 0.0003 * k)
    assert fit.coefficients()[0] == pytest.approx(0.001)  # (every plan asks)
    for _ in range(fit.WINDOW):  # the old lengths leave the window
        fit.observe(1, 1, 0.0026)  # the machine got 2x slower meanwhile
    c, a, b = fit.coefficients()
    assert c == pytest.approx(0.002) and a + b == pytest.approx(0.0006)
    assert c + 4 * (a + b) < 0.5 * 4 * 0.0026  # not four one-draft proposals


def _dear_first_draft(per_call: float) -> DraftLengthController:
    """Batch 1, a 1 ms step, drafts that survive 4 in 5: proposing costs ``per_call``
    plus 0.1 ms a draft (the fit learns it from proposals of 1-4 drafts)."""
    cfg = SpeculativeConfig("draft_model", model="x", num_speculative_tokens=4)
    ctl = DraftLengthController(cfg, FixedCost(a=0.001, b=0.0))
    ctl._glob_acc, ctl._glob_try = [0.8] * 4, [1.0] * 4
    for k in (1, 2, 3, 4, 1, 2):
        ctl.observe_proposals({"r0": k}, per_call + 0.0001 * k)
    return ctl


def test_a_proposal_dear_to_start_drafts_long_not_nothing():
    """A proposal whose first draft costs more than it brings but whose next ones are
    cheap: drafting one loses, drafting four wins. The plan takes the best prefix of
    slots, not the first that does not pay: k = 4 (the old rule stopped at k = 0)."""
    ctl = _dear_first_draft(0.0008)
    rows = _rows(1)
    ctl.plan(rows, 0, 1, 1, 512)
    # One draft: 1.8 expected tokens in 1 + 1.2 x 0.9 ms (0.87 a ms, against 1 a ms
    # without); four: 3.36 in 1 + 1.2 x 1.2 ms (1.38 a ms). Every k by the same rule:
    c, a, b = ctl.proposal_cost.coefficients()
    rates = []
    for k in range(5):
        e = 1 + sum(0.8 ** j for j in range(1, k + 1))
        t = 0.001 + (k > 0) * c + k * (a + b)
        rates.append(e / (0.001 + 1.2 * (t - 0.001)))
    assert rows[0].k_want == max(range(5), key=rates.__getitem__) == 4
    # Dearer still: no prefix pays, none is taken.
    ctl = _dear_first_draft(0.004)
    rows = _rows(1)
    ctl.plan(rows, 0, 1, 1, 512)
    assert rows[0].k_want == 0


def test_the_plan_is_the_best_prefix_of_slots_by_brute_force():
    """Against every plan of a small batch (each request 0..cap drafts): the plan
    taken rates within a hair of the best of them by the rule's own measure."""
    import functools
    import itertools
    import random

    rng = random.Random(5)
    # (n-gram: a draft model's first drafts are bounded by a round each, more strictly.)
    cfg = SpeculativeConfig("ngram", num_speculative_tokens=3)
    for trial in range(60):
        n = rng.randint(1, 3)
        ctl = DraftLengthController(cfg, FixedCost(a=rng.uniform(0.0005, 0.003),
                                                   b=rng.uniform(0.00002, 0.0004)))
        ctl._glob_acc = [rng.uniform(0.2, 0.95) for _ in range(3)]
        ctl._glob_try = [1.0] * 3
        per_call, per_round = rng.uniform(0, 0.002), rng.uniform(0, 0.0008)
        ctl.proposal_cost._solved = (per_call, per_round, 0.00001)
        rows = _rows(n, drafts=3, cap=3)
        ctl.plan(rows, 0, n, n, 512)
        t0 = ctl.cost.step_time(BatchShape(num_decodes=n))
        plan_rate = functools.partial(_plan_rate, n, ctl.prior(), t0,
                                      ctl.cost.b + 0.00001, per_round, per_call)
        got = plan_rate(tuple(r.k_want for r in rows))
        best = max(plan_rate(ks) for ks in itertools.product(range(4), repeat=n))
        assert got >= best * 0.97, (trial, [r.k_want for r in rows], got, best)


def _plan_rate(n: int, prior: list[float], t0: float, per_slot: float, per_round: float,
               per_call: float, ks: tuple[int, ...]) -> float:
    """The rule's measure of a plan: expected tokens per second, added costs x 1.2."""
    e = n + sum(sum(math.prod(prior[:j]) for j in range(1, k + 1)) for k in ks)
    added = sum(ks) * per_slot + max(ks) * per_round + (per_call if any(ks) else 0.0)
    return e / (t0 + 1.2 * added)


# ---- the outcome guard -----------------------------------------------------------------
def test_outcome_guard_switches_a_losing_batch_size_off_and_tries_again():
    from conveyor.spec.outcome_guard import OutcomeGuard as G

    g = G()
    for i in range(G.MIN_ON):
        assert g.allows(8), i
        g.observe(8, 0, 8, 10, 0.012, 0.002)  # drafted: 1.4 ms a token, proposer included
    # Nothing clean to compare with yet: an off trial (no drafts, no proposals).
    assert not g.allows(8) and g.num_trials == 1 and g.num_switched_off == 0
    steps = 0
    while g.num_switched_off == 0:
        g.observe(8, 0, 0, 8, 0.010, 0.0)  # draft-free: 1.25 ms a token
        steps += 1
        assert steps <= G.TRIAL + 1  # the step right after proposals is not clean
    assert steps == G.TRIAL + 1
    assert not g.allows(8)
    assert g.allows(1) and g.allows(64)  # other batch sizes keep their own verdicts
    assert g.allows(9) is False  # 8..15 share a bucket
    for _ in range(G.COOL_OFF):
        g.observe(8, 0, 0, 8, 0.010, 0.0)
    assert g.allows(8)  # the cool-off is over: tried afresh
    for _ in range(G.MIN_ON):  # the cool-off's steps are the comparison: no trial
        g.observe(8, 0, 8, 10, 0.012, 0.002)
    assert not g.allows(8) and g.num_switched_off == 2 and g.num_trials == 1
    steps = 0
    while not g.allows(8):
        g.observe(8, 0, 0, 8, 0.010, 0.0)
        steps += 1
    assert steps == 2 * G.COOL_OFF  # a second loss waits twice as long


def test_outcome_guard_keeps_drafts_that_pay_with_ever_fewer_trials():
    from conveyor.spec.outcome_guard import OutcomeGuard as G

    g = G()
    drafted = 0
    for _ in range(2000):
        if g.allows(4):
            g.observe(4, 0, 8, 9, 0.012, 0.003)  # 1.7 ms a token: pays
            drafted += 1
        else:
            g.observe(4, 0, 0, 4, 0.010, 0.0)  # a trial step: 2.5 ms a token
        g.observe(4, 300, 0, 4, 0.5, 0.0)  # a prefill step: not the drafts' cost
    assert g.num_switched_off == 0
    # Verdicts after 12, 24, 48, ... drafted steps, then every MAX_NEED_ON: a dozen
    # trials, not one per 12 drafted steps.
    assert 6 <= g.num_trials <= 14 and drafted >= 2000 - 14 * (G.TRIAL + 1)
    # The proposer's time counts against the drafts: the same steps with a dear proposer.
    for _ in range(G.MAX_NEED_ON + 2 * (G.TRIAL + 1)):
        if g.num_switched_off:
            break
        if g.allows(4):
            g.observe(4, 0, 8, 9, 0.012, 0.020)  # 3.6 ms a token
        else:
            g.observe(4, 0, 0, 4, 0.010, 0.0)
    assert g.num_switched_off == 1 and not g.allows(4)


def test_a_win_no_drift_explains_skips_the_trial():
    """Drafted steps at under WIN_MARGIN x the off cost of the last trial drafts won need
    no new trial (one per WON_AGE steps still runs); once the drafts stop paying, the
    next verdict runs its trial again and switches them off."""
    from conveyor.spec.outcome_guard import OutcomeGuard as G

    g = G()
    steps = 3000
    for _ in range(steps):
        if g.allows(1):
            g.observe(1, 0, 4, 4, 0.004, 0.0005)  # 1.1 ms a token
        else:
            g.observe(1, 0, 0, 1, 0.0025, 0.0)  # a trial step: 2.5 ms a token
    assert g.num_switched_off == 0
    # Without the skip: a trial per verdict, after 12, 24, ..., then every 256 drafted
    # steps (about 15 here).
    assert 2 <= g.num_trials <= 1 + -(-steps // G.WON_AGE)
    trials = g.num_trials
    for _ in range(2 * G.MAX_NEED_ON + 10):
        if g.num_switched_off:
            break
        if g.allows(1):
            g.observe(1, 0, 4, 1, 0.004, 0.0005)  # 4.5 ms a token: a loss
        else:
            g.observe(1, 0, 0, 1, 0.0025, 0.0)
    assert g.num_switched_off == 1 and g.num_trials == trials + 1


def test_a_loss_within_the_steps_noise_waits_for_more_drafted_steps():
    """Drafted steps that vary (a request's drafts hit or miss) and lose a little on
    average are not switched off at the first verdict: more drafted steps first, and the
    estimate decides after MAX_UNSURE verdicts put off. A clear loss switches off at once."""
    from conveyor.spec.outcome_guard import OutcomeGuard as G

    def run(on_costs, steps):
        g = G()
        for i in range(steps):
            if g.allows(8):
                tokens = 10
                g.observe(8, 0, 8, tokens, on_costs[i % 2] * tokens, 0.0)
            else:
                g.observe(8, 0, 0, 8, 0.00115 * 8, 0.0)  # off: 1.15 ms a token
            if g.num_switched_off:
                break
        return g, i

    g, steps = run((0.0010, 0.0014), 400)  # 1.2 ms a token on average, +-0.2 a step
    assert g.num_switched_off == 1  # the estimate decides in the end
    assert steps > 3 * G.MIN_ON  # ... after drafted steps beyond the first verdict's
    g, steps = run((0.0018, 0.0022), 400)  # 2 ms a token: clearly losing
    assert g.num_switched_off == 1 and steps < G.MIN_ON + 2 * (G.TRIAL + 1)


def test_a_verdict_compares_with_fresh_off_steps_only():
    """Clean steps from long ago (another phase of the run: the machine's speed drifts)
    are not what drafted steps are judged against now: an off trial first."""
    from conveyor.spec.outcome_guard import OutcomeGuard as G

    g = G()
    for _ in range(G.TRIAL + 1):
        g.observe(8, 0, 0, 8, 0.004, 0.0)  # batch 8, clean and fast (0.5 ms a token)
    for _ in range(G.FRESH_OFF + 1):
        g.observe(64, 0, 0, 64, 0.02, 0.0)  # other sizes meanwhile
    for _ in range(G.MIN_ON):
        g.observe(8, 0, 8, 12, 0.012, 0.001)  # drafted: 1.08 ms a token
    assert g.num_switched_off == 0 and g.num_trials == 1 and not g.allows(8)
    for _ in range(G.TRIAL + 1):  # the trial (the step right after proposals is not
        g.observe(8, 0, 0, 8, 0.012, 0.0)  # clean), on today's machine: 1.5 ms a token
    assert g.num_switched_off == 0 and g.allows(8)  # drafts pay against fresh off steps


def test_drafts_that_pay_at_a_batch_size_vouch_for_the_smaller_ones():
    """A win at batch 8 spares batches 1-7 their early off trials (a batch's tail passes
    through every smaller size a few steps each); a loss measured at a smaller size
    stands, and larger sizes are not vouched for."""
    from conveyor.spec.outcome_guard import OutcomeGuard as G

    g = G()
    for _ in range(G.MIN_ON):  # batch 2 drafts and loses against its trial: cool-off
        g.observe(2, 0, 4, 3, 0.012, 0.002)
    while g.num_switched_off == 0:
        g.observe(2, 0, 0, 2, 0.004, 0.0)
    assert not g.allows(2)
    while g._buckets.get(4) is None or g._buckets[4].need_on == G.MIN_ON:
        if g.allows(8):  # batch 8 drafts and wins its first verdict (after a trial)
            g.observe(8, 0, 8, 12, 0.012, 0.001)
        else:
            g.observe(8, 0, 0, 8, 0.012, 0.0)
    need = g._buckets[4].need_on
    assert need == 2 * G.MIN_ON and g.num_switched_off == 1
    trials = g.num_trials
    for _ in range(need - 1):  # batch 1 drafts as long as batch 8 waits, no trial
        assert g.allows(1)
        g.observe(1, 0, 4, 3, 0.004, 0.001)
    assert g.num_trials == trials
    g.observe(1, 0, 4, 3, 0.004, 0.001)
    assert g.num_trials == trials + 1  # its own first verdict, after batch 8's wait
    assert not g.allows(2)  # batch 2's measured loss stands
    for _ in range(G.MIN_ON):  # batch 16 is not vouched for: its first verdict at 12
        g.observe(16, 0, 16, 20, 0.02, 0.001)
    assert g.num_trials == trials + 2


def test_a_measured_loss_overrules_a_wrong_cost_estimate():
    """The step-cost estimate says drafts are nearly free (a big fixed cost per step);
    the steps as measured say a drafted step costs more per token than a plain one. The
    measurement wins: no drafts and no proposals at that batch size, others unaffected."""
    cfg = SpeculativeConfig("ngram", num_speculative_tokens=4)
    ctl = DraftLengthController(cfg, FixedCost(a=0.05, b=0.0001))
    rows = _rows(4)
    ctl.plan(rows, 0, 4, 4, 512)
    assert all(r.k_want == 4 and r.k_now == 4 for r in rows)  # the estimate: drafts pay
    for _ in range(4):  # clean steps: no drafts, no proposals
        ctl.observe_step(4, 0, 0, 4, 0.010, 0.0)
    for _ in range(16):
        ctl.observe_step(4, 0, 16, 6, 0.018, 0.001)  # 3.2 ms a token against 2.5
    rows = _rows(4)
    ctl.plan(rows, 0, 4, 4, 512)
    assert all(r.k_want == 0 and r.k_now == 0 for r in rows) and ctl.k_want_for(4) == 0
    m = ctl.metrics.as_dict()
    assert m["num_guard_switch_offs"] == 1 and m["num_guard_off_steps"] == 1
    # The scheduler asks first: no rows are built at that size while it is off.
    assert ctl.dormant(4) and ctl.metrics.num_guard_off_steps == 2
    rows = _rows(1)  # batch 1 has its own verdict (none yet): the estimate decides
    ctl.plan(rows, 0, 1, 1, 512)
    assert rows[0].k_want == 4
    fixed = DraftLengthController(SpeculativeConfig("ngram", num_speculative_tokens=4,
                                                    adaptive=False), None)
    for _ in range(16):
        fixed.observe_step(4, 0, 16, 6, 0.018, 0.001)
    rows = _rows(4)
    fixed.plan(rows, 0, 4, 4, 512)
    assert all(r.k_now == 4 for r in rows)  # a fixed k is what the user asked for


def test_a_fit_that_found_drafts_dear_probes_them_again():
    """Fitted on draft-free steps and a few slow early drafted ones, a batch size's fit
    says drafts are dear and nothing would ever re-measure them: every PROBE_EVERY
    draft-free steps it asks for one step with drafts, whatever the rule says."""
    from conveyor.spec.step_cost_fit import BatchStepCost

    cost = BatchStepCost()
    cost.observe(0, 1, 0.001, batch=1)
    cost.observe(0, 5, 0.005, batch=1)  # a first drafted step, slowed by first-call costs
    for _ in range(BatchStepCost.PROBE_EVERY - 1):
        cost.observe(0, 1, 0.001, batch=1)
    assert not cost.needs_probe(1)
    cost.observe(0, 1, 0.001, batch=1)
    assert cost.needs_probe(1) and not cost.needs_probe(8)  # per batch size
    cfg = SpeculativeConfig("ngram", num_speculative_tokens=4)
    ctl = DraftLengthController(cfg, cost)
    rows = _rows(1)
    ctl.plan(rows, 0, 1, 1, 512)
    assert rows[0].k_want == 4 and rows[0].k_now == 4  # proposed, and verified on hand
    assert ctl.metrics.as_dict()["num_probe_steps"] == 1
    cost.observe(0, 5, 0.0012, batch=1)  # the probe: drafts are cheap after all
    assert not cost.needs_probe(1)
    rows = _rows(1)
    ctl.plan(rows, 0, 1, 1, 512)
    assert rows[0].k_want > 0  # the refitted slope lets the rule draft by itself



@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_probe_verifies_enough_drafts_to_measure_a_row(method):
    """One request's drafts against the step's noise priced a row at 3x its cost and
    kept drafting off: a probe verifies PROBE_DRAFTS drafts, each request to its cap (a
    draft model's from at most PROBE_DRAFT_MODEL_ROWS requests: each catches up)."""
    from conveyor.spec.step_cost_fit import BatchStepCost

    cost = BatchStepCost()
    cost.observe(0, 8, 0.001, batch=8)
    cost.observe(0, 12, 0.1, batch=8)  # a first drafted step, slowed by first-call costs
    for _ in range(BatchStepCost.PROBE_EVERY):
        cost.observe(0, 8, 0.001, batch=8)
    assert cost.needs_probe(8)
    cfg = SpeculativeConfig(method, num_speculative_tokens=4, model="unused")
    ctl = DraftLengthController(cfg, cost)
    rows = _rows(8)
    ctl.plan(rows, 0, 8, 8, 512)
    wants = sorted((r.k_want for r in rows), reverse=True)
    assert wants == [4] * 4 + [0] * 4  # 16 drafts
    assert DraftLengthController.PROBE_DRAFT_MODEL_ROWS == 4
    few = _rows(8, cap=2)  # caps of 2: ngram spreads 16 over 8, a draft model over 4
    ctl.plan(few, 0, 8, 8, 512)
    wants = sorted((r.k_want for r in few), reverse=True)
    assert wants == ([2] * 8 if method == "ngram" else [2] * 4 + [0] * 4)
    assert ctl.k_want_for(8) == 0  # new requests get the rule's length, not the probe's

def test_probes_back_off_while_the_rule_keeps_refusing():
    from conveyor.spec.step_cost_fit import BatchStepCost

    cost = BatchStepCost()
    cost.observe(0, 1, 0.001, batch=1)
    cost.observe(0, 5, 0.05, batch=1)  # drafts really are dear here
    waits = []
    for _ in range(3):
        n = 0
        while not cost.probe(1, rule_drafted=False):
            cost.observe(0, 1, 0.001, batch=1)
            n += 1
        waits.append(n)
        assert cost.probe(1, rule_drafted=False)  # the step after verifies the proposals
        cost.observe(0, 5, 0.05, batch=1)  # the probe's step: still dear
        assert not cost.probe(1, rule_drafted=False)  # the verdict: refused, back off
    assert waits[1] >= 2 * BatchStepCost.PROBE_EVERY - 2 and waits[2] >= 2 * waits[1] - 2
    assert not cost.probe(1, rule_drafted=True)  # the rule drafting by itself resets it
    for _ in range(BatchStepCost.PROBE_EVERY):
        cost.observe(0, 1, 0.001, batch=1)
    assert cost.probe(1, rule_drafted=False)


def test_a_position_that_looked_bad_early_is_explored_again():
    """Position 2's first tries failed, so the rule stops at one draft and would never
    measure position 2 again: every EXPLORE_EVERY drafting steps one request proposes one
    more than the rule chose, and the next step verifies it whatever the rule says."""
    cfg = SpeculativeConfig("ngram", num_speculative_tokens=4)
    ctl = DraftLengthController(cfg, FixedCost(a=0.005, b=0.0001))
    for _ in range(5):  # a draft costs 2 ms to propose: worth it only where likely
        ctl.observe_proposals({"r0": 1}, 0.002)
    for _ in range(3):  # position 1 survives, position 2 never did
        ctl.observe(_rows(1)[0].request, 2, 1)
    for _ in range(40):
        ctl.observe(_rows(1)[0].request, 1, 1)
    explored, on_hand = [], 1
    for _ in range(2 * DraftLengthController.EXPLORE_EVERY + 2):
        rows = _rows(1, drafts=on_hand)  # what its last step proposed
        ctl.plan(rows, 0, 1, 1, 512)
        explored.append((rows[0].k_want, rows[0].k_now))
        on_hand = rows[0].k_want
    assert explored[0] == (1, 1)  # the rule alone: one draft
    i = explored.index((2, 1))  # one more proposed (what it has on hand is verified next)
    assert explored[i + 1][1] == 2  # both drafts verified, though the rule wants one
    assert ctl.metrics.as_dict()["num_explore_steps"] == 2
    assert ctl.k_want_for(1) == 1  # new requests get the rule's length, not the exploration's


def test_a_new_decode_is_asked_for_the_drafts_its_batch_size_pays_for():
    """A request whose prompt ends this step proposes its first drafts now, as many as
    the last plan at the next step's batch size chose: not the count of the last plan at
    some other size (a draft model would catch up on whole prompts for drafts the next
    plan refuses). A size not planned yet takes the nearest smaller one's."""
    cfg = SpeculativeConfig("ngram", num_speculative_tokens=4)
    ctl = DraftLengthController(cfg, FixedCost(a=0.05, b=0.001))
    assert ctl.k_want_for(8) == 4  # nothing planned yet: the configured length
    ctl.plan(_rows(64), 0, 64, 64, 512)  # saturated: no draft pays
    ctl.plan(_rows(1), 0, 1, 1, 512)  # alone: every one does (asserted below)
    assert ctl.k_want_for(64) == 0 and ctl.k_want_for(100) == 0
    assert ctl.k_want_for(1) == 4 and ctl.k_want_for(3) == 4  # (3: batch 1's plan)


def test_a_step_of_last_tokens_leaves_the_choice_as_it_was():
    """Rows that can take no draft (each request on its last token) decide nothing: the
    next request at that batch size is still asked for what the last real plan chose,
    and planning is not put to sleep."""
    cfg = SpeculativeConfig("draft_model", num_speculative_tokens=4, model="unused")
    ctl = DraftLengthController(cfg, FixedCost(a=0.05, b=0.001))
    assert ctl.plan(_rows(1), 0, 1, 1, 512) and ctl.k_want_for(1) == 4
    ending = _rows(1, cap=0)
    assert not ctl.plan(ending, 0, 1, 1, 512)
    assert ending[0].k_want == 0 and ending[0].k_now == 0
    assert ctl.k_want_for(1) == 4 and not ctl.dormant(1)
    assert ctl.plan(_rows(1), 0, 1, 1, 512)  # the next request drafts at once
    # Nor does a plan over rows that can take fewer drafts than k (requests near their
    # end), whatever it decides: a dear one refuses, and the next request is still
    # asked for 4.
    dear_cost = FixedCost(a=0.05, b=0.001)
    ctl = DraftLengthController(cfg, dear_cost)
    assert ctl.plan(_rows(1), 0, 1, 1, 512) and ctl.k_want_for(1) == 4
    dear_cost.b = 0.05
    assert not ctl.plan(_rows(1, cap=1), 0, 1, 1, 512)
    assert ctl.k_want_for(1) == 4 and not ctl.dormant(1)
    # A plan with a full row that decided "none" still does both.
    assert not ctl.plan(_rows(1), 0, 1, 1, 512)
    assert ctl.k_want_for(1) == 0 and ctl.dormant(1)


def test_drafts_are_priced_against_the_steps_decode_part_alone():
    """A step of 8 decodes and 1,000 prefill tokens yields 8 tokens in a second: against
    that, a decode row's millisecond looks cheap, but the drafts it proposes are verified
    in the decode steps after it, where they do not pay. Priced against its decode part,
    it drafts exactly where a decode-only step does."""
    cfg = SpeculativeConfig("ngram", num_speculative_tokens=4)
    for cost, pays in ((FixedCost(a=0.0001, b=0.001), False),  # a row is the step's cost
                       (FixedCost(a=0.05, b=0.001), True)):  # a step is mostly fixed
        for num_prefill in (0, 1000):
            ctl = DraftLengthController(cfg, cost)
            rows = _rows(8)
            ctl.plan(rows, num_prefill, 8, 8, 512)
            assert any(r.k_want for r in rows) == pays, (cost.a, num_prefill)


def test_a_draft_models_catch_up_is_charged_to_the_first_draft():
    """A draft model's request that did not propose last step catches up on the text
    since it did before its first draft: measured per token from proposals that caught
    up (over what the steady proposal cost predicts), charged to the first draft of a
    row with a long catch-up; a steady row is not charged."""
    cfg = SpeculativeConfig("draft_model", num_speculative_tokens=4, model="unused")
    ctl = DraftLengthController(cfg, FixedCost(a=0.01, b=0.0005))
    assert ctl.catch_up_s_per_token is None
    ctl.observe_catch_up({"r0": 1}, 0, 0.5)  # (no catch-up tokens: nothing learnt)
    assert ctl.catch_up_s_per_token is None
    rows = _rows(2)
    rows[0].catch_up = 300  # (unmeasured: not charged yet)
    ctl.plan(rows, 0, 2, 2, 512)
    assert rows[0].k_want > 0 and rows[1].k_want > 0
    ctl.observe_catch_up({"r0": 1, "r1": 1}, 400, 0.04)  # 0.1 ms a token (no steady fit)
    assert ctl.catch_up_s_per_token == pytest.approx(1e-4)
    rows = _rows(2)
    rows[0].catch_up = 300  # 30 ms before its first draft: not worth a 10 ms step's drafts
    rows[1].catch_up = DraftLengthController.STEADY_CATCH_UP  # steady: no charge
    ctl.plan(rows, 0, 2, 2, 512)
    assert rows[0].k_want == 0 and rows[1].k_want > 0


def test_a_catch_up_is_spread_over_the_steps_it_serves():
    """A catch-up is paid once and serves every later step's drafts: its price is spread
    over the steps the request will draft for (its remaining output at a drafting step's
    yield, up to CATCH_UP_HORIZON), so a 10 ms catch-up against a 10 ms step pays for a
    request with 100 tokens to go, and not for one with 2."""
    cfg = SpeculativeConfig("draft_model", num_speculative_tokens=4, model="unused")
    ctl = DraftLengthController(cfg, FixedCost(a=0.01, b=0.0005))
    ctl.observe_catch_up({"r0": 1, "r1": 1}, 400, 0.04)  # 0.1 ms a token
    long_left, short_left = _rows(1), _rows(1, cap=1)
    long_left[0].catch_up = short_left[0].catch_up = 100  # 10 ms, whole
    short_left[0].request.max_tokens = 2
    ctl.plan(long_left, 0, 1, 1, 512)
    assert long_left[0].k_want > 0
    ctl.plan(short_left, 0, 1, 1, 512)
    assert short_left[0].k_want == 0
    prior = ctl.prior()
    assert ctl._catch_up_steps(long_left[0], prior) == DraftLengthController.CATCH_UP_HORIZON
    # 2 tokens left at 1 + P(draft 1 survives) a step (cap 1)
    assert ctl._catch_up_steps(short_left[0], prior) == pytest.approx(
        2 / (1 + ctl.acceptance(short_left[0].request, prior)[0]))


def test_a_plan_that_drafts_nothing_is_reused_for_a_few_steps_of_that_size():
    """Nothing verified, no acceptance moved: the next steps at the same batch size skip
    the planning (and the scheduler builds no rows for them), then plan afresh; each
    further plan in a row that drafts nothing is reused twice as long, up to a cap, and
    a plan that drafts starts the count again."""
    cost = FixedCost(a=0.0001, b=0.01)  # a decode row is dear
    ctl = DraftLengthController(SpeculativeConfig("ngram", num_speculative_tokens=4), cost)
    n = DraftLengthController.DORMANT_STEPS

    def reused(batch: int) -> int:
        steps = 0
        while ctl.dormant(batch):
            steps += 1
        return steps

    assert not ctl.plan(_rows(2), 0, 2, 2, 512)
    assert not ctl.dormant(3)  # another batch size plans for itself
    assert reused(2) == n - 1  # then planned afresh
    assert ctl.metrics.num_decode_steps == 2 * n
    top = DraftLengthController.MAX_DORMANT_DOUBLINGS
    runs = []
    for _ in range(top + 1):
        assert not ctl.plan(_rows(2), 0, 2, 2, 512)
        runs.append(reused(2) + 1)
    assert runs == [n << min(i, top) for i in range(1, top + 2)]  # 2n, 4n, ..., capped
    cost.b = 0.00001  # a cheap row: the plan drafts
    assert ctl.plan(_rows(2), 0, 2, 2, 512)
    cost.b = 0.01
    assert not ctl.plan(_rows(2), 0, 2, 2, 512)
    assert reused(2) == n - 1
    cheap = DraftLengthController(SpeculativeConfig("ngram", num_speculative_tokens=4),
                                  FixedCost(a=0.05, b=0.0001))
    assert cheap.plan(_rows(2), 0, 2, 2, 512) and not cheap.dormant(2)  # it drafts: no reuse
