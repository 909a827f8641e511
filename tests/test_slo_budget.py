"""The SLO token budget controller (core/budget.py) and the ``slo`` policy, on a virtual
clock with a fake runner: no torch, no model, no wall time. Step times come from the
same linear cost model the controller predicts with, so a prediction is the step."""

from __future__ import annotations

import logging
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_harness import Sim, make_req
from test_policies_properties import assert_exact_outputs

from conveyor.config import EngineArgs, PolicyConfig, SchedulerConfig
from conveyor.core.batch_shape import batch_shape
from conveyor.core.budget import BudgetController, budget_mode
from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.core.scheduler import SLO_REJECTED, Scheduler
from conveyor.costs.linear import LinearStepCost
from conveyor.costs.shape import BatchShape
from conveyor.request import RequestStatus

SETTINGS = settings(max_examples=40, deadline=None)
# 2 ms a step + 0.1 ms a token.
COST = LinearStepCost(0.002, 1e-4, 0.0)
# GPU-like: 10 ms a step whatever it holds (weights streamed) + 20 us a token, so that
# small chunks waste steps: a 1,900-token prefill step takes ~48 ms, a 128-token one 12.6.
FLAT = LinearStepCost(0.010, 2e-5, 0.0)


def make_sched(policy: str = "slo", cost=COST, ceiling: int = 2048, max_num_seqs: int = 16,
               num_blocks: int = 4096, block_size: int = 16, token_budget: str = "auto",
               policy_config: PolicyConfig | None = None, **kwargs) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, kwargs.pop("enable_prefix_caching", False))
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=ceiling,
                          scheduling_policy=policy, token_budget=token_budget,
                          policy=policy_config or PolicyConfig(), **kwargs)
    return Scheduler(cfg, kv, num_blocks * block_size, step_cost=cost)


def step_time(cost=COST):
    return lambda out: cost.step_time(batch_shape(out))


def tpot(req) -> float | None:
    n = req.num_output_tokens
    return None if n < 2 else (req.last_token_time - req.first_token_time) / (n - 1)


def ttft(req) -> float:
    return req.first_token_time - req.arrival_time


# ---- the controller alone ----------------------------------------------------------------
def test_fit_keeps_the_ceiling_and_a_token_for_every_priced_decode() -> None:
    ctrl = BudgetController(COST, ceiling=100)
    decoding = [make_req(f"d{i}", 10, 5) for i in range(3)]
    for r in decoding:
        r.num_computed_tokens = r.num_tokens - 1  # one token left: a decode
    ctrl.begin_step(0.0, decoding)
    assert ctrl.tokens_left == 97 and ctrl.limit_s == math.inf  # no TPOT target: no limit
    big, small = make_req("big", 500, 1), make_req("small", 10, 1)
    assert ctrl.fit(big, 0, 500) == 97  # the ceiling, minus the decodes' tokens
    ctrl.add(big, 0, 97)
    assert ctrl.fit(small, 0, 10) == 0


def test_fit_cuts_the_chunk_to_the_tightest_tpot_deadline() -> None:
    ctrl = BudgetController(COST, ceiling=4096)
    r = make_req("d", 10, 50, slo_tpot_s=0.02)
    r.num_computed_tokens = r.num_tokens  # one output token out, its decode next
    r.append_output_token(7)
    r.first_token_time = 1.0
    ctrl.begin_step(1.005, [r])  # due at 1.02: 15 ms left
    n = ctrl.fit(make_req("p", 4000, 1), 0, 4000)
    assert 0 < n < 4000
    assert ctrl.limit_s == pytest.approx(0.015)
    assert ctrl.cost.step_time(BatchShape(n, 1, 0, n, 1, 11, 11, 1)) <= ctrl.limit_s
    assert ctrl.cost.step_time(BatchShape(n + 1, 1, 0, n + 1, 1, 11, 11, 1)) > ctrl.limit_s
    # A decode that can no longer meet its target (even decode-only from now on) is not
    # protected: its TPOT is lost, and protecting it would only starve prefill.
    ctrl.begin_step(5.0, [r])
    assert ctrl.limit_s == math.inf and ctrl.stats.num_lost_decodes == 1


def test_a_prompt_finishing_on_time_caps_the_step_at_its_ttft_deadline() -> None:
    ctrl = BudgetController(COST, ceiling=4096)
    ctrl.begin_step(0.0, [])
    urgent = make_req("urgent", 50, 1, slo_ttft_s=0.02)  # 7 ms alone, due in 20 ms
    ctrl.add(urgent, 0, 50)
    assert ctrl.limit_s == pytest.approx(0.02)
    n = ctrl.fit(make_req("next", 3000, 1, slo_ttft_s=5.0), 0, 3000)
    assert 0 < n < 3000 and ctrl.cost.step_time(BatchShape(50 + n, 2, 0, 50 + n, 0, 0, 0, 1)
                                                ) <= 0.02
    # A first token that is late anyway does not hold the step back.
    ctrl.begin_step(1.0, [])
    ctrl.add(make_req("late", 50, 1, slo_ttft_s=0.02), 0, 50)
    assert ctrl.limit_s == math.inf


def test_admit_grows_a_decode_by_draft_tokens_only_while_time_is_left() -> None:
    ctrl = BudgetController(COST, ceiling=4096)
    r = make_req("d", 10, 50, slo_tpot_s=0.0035)
    r.num_computed_tokens = r.num_tokens
    r.append_output_token(7)
    r.first_token_time = 0.0
    ctrl.begin_step(0.0, [r])  # 3.5 ms: the 2.1 ms decode leaves room for ~13 tokens
    assert ctrl.admit(r, 4)
    assert ctrl.predicted_step_s == pytest.approx(0.002 + 5e-4)
    assert r.request_id not in ctrl.decode_ids
    other = make_req("e", 10, 50)
    assert not ctrl.admit(other, 1), "only a priced decode can grow"
    r2 = make_req("f", 10, 50, slo_tpot_s=0.0035)
    r2.num_computed_tokens = r2.num_tokens
    r2.append_output_token(7)
    r2.first_token_time = 0.0
    ctrl.begin_step(0.0, [r2])
    assert not ctrl.admit(r2, 20), "20 drafts would take the step past 3.5 ms"
    assert ctrl.predicted_step_s == pytest.approx(0.0021), "a refusal changes nothing"


def test_without_a_cost_model_the_budget_stays_fixed_and_says_why(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="conveyor.core.scheduler"):
        sched = make_sched(cost=None)
    assert sched.budget_ctrl is None and sched.budget_mode == "fixed"
    assert "no step-cost model" in sched.budget_reason
    assert any("no step-cost model" in r.getMessage() for r in caplog.records)
    assert budget_mode("auto", "fcfs", "continuous", COST)[0] == "fixed"
    assert budget_mode("slo", "fcfs", "continuous", COST)[0] == "slo"
    assert budget_mode("slo", "slo", "static", COST)[0] == "fixed"
    with pytest.raises(ValueError, match="token_budget"):
        SchedulerConfig(token_budget="dynamic")


# ---- the scenario: a fixed budget misses TPOT, the controller holds it -------------------
def tpot_scenario(policy: str, ceiling: int, token_budget: str = "auto") -> Sim:
    """Four chats decoding under a 20 ms TPOT target while twelve 1,900-token prompts
    with a loose 200 ms TPOT target arrive (one every 50 ms), on the FLAT cost: a fixed
    budget of 2,048 runs each prompt in one ~48 ms step that stalls every chat; a budget
    of 128 keeps TPOT but starves the prompts, also once the chats are gone."""
    reqs = [make_req(f"chat{i}", 32, 40, arrival=0.0, slo_ttft_s=1.0, slo_tpot_s=0.02)
            for i in range(4)]
    reqs += [make_req(f"long{i}", 1900, 4, arrival=0.05 + 0.05 * i, slo_ttft_s=10.0,
                      slo_tpot_s=0.2) for i in range(12)]
    sim = Sim(make_sched(policy, cost=FLAT, ceiling=ceiling, token_budget=token_budget),
              reqs, step_time=step_time(FLAT))
    sim.run()
    assert_exact_outputs(sim)
    return sim


def test_a_fixed_budget_misses_tpot_where_the_controller_holds_it() -> None:
    fixed = tpot_scenario("fcfs", 2048)
    chats = [r for rid, r in fixed.all.items() if rid.startswith("chat")]
    assert min(tpot(r) for r in chats) > 0.02, "the big fixed budget stalls every chat"

    small = tpot_scenario("fcfs", 128)
    held = tpot_scenario("slo", 2048)
    for sim in (small, held):
        assert all(tpot(r) <= r.slo_tpot_s + 1e-12 for r in sim.all.values()), "TPOT held"
    ctrl = held.sched.budget_ctrl
    assert ctrl.stats.num_time_bound > 0 and ctrl.stats.num_over_limit == 0
    # ... and the controller keeps TTFT far below what the small fixed budget gives.
    longs = [rid for rid in held.all if rid.startswith("long")]
    mean_ttft = {name: sum(ttft(sim.all[rid]) for rid in longs) / len(longs)
                 for name, sim in (("small", small), ("held", held))}
    assert mean_ttft["held"] < 0.6 * mean_ttft["small"], mean_ttft


def test_the_controller_alone_holds_tpot_under_fcfs_too() -> None:
    sim = tpot_scenario("fcfs", 2048, token_budget="slo")
    assert all(tpot(r) <= r.slo_tpot_s + 1e-12 for r in sim.all.values())


# ---- properties --------------------------------------------------------------------------
slo_workloads = st.lists(
    st.fixed_dictionaries({
        "prompt": st.integers(1, 60), "max_tokens": st.integers(1, 10),
        "arrival": st.integers(0, 30), "tenant": st.sampled_from("abc"),
        "ttft": st.one_of(st.none(), st.sampled_from([0.005, 0.02, 0.1, 1.0])),
        "tpot": st.one_of(st.none(), st.sampled_from([0.001, 0.0025, 0.004, 0.05])),
    }),
    min_size=1, max_size=30)


@SETTINGS
@given(slo_workloads, st.integers(8, 64), st.integers(1, 6), st.sampled_from([8, 24, 96]),
       st.sampled_from(["serve", "reject"]), st.sampled_from(["slack", "fair"]),
       st.booleans())
def test_controller_keeps_ceiling_decodes_and_deadlines_and_everything_finishes(
        workload, ceiling, max_seqs, num_blocks, late, tie, caching) -> None:
    """Every step: within the ceiling (the harness checks), every running decode is
    scheduled unless preempted, and a step that took any prefill chunk ends by every
    protected decode's deadline (prediction = step time here). Every request finishes,
    or never ran and was rejected past its latest start (reject mode only)."""
    cost = LinearStepCost(0.001, 1e-4, 5e-5)
    sched = make_sched(cost=cost, ceiling=ceiling, max_num_seqs=max_seqs,
                       num_blocks=num_blocks, block_size=4, enable_prefix_caching=caching,
                       policy_config=PolicyConfig(slo_late_action=late, slo_tie_break=tie,
                                                  slo_tie_quantum_s=0.01))
    reqs = []
    for i, w in enumerate(workload):
        prompt = [(i * 7 + k) % 89 + 5 for k in range(w["prompt"])] if not caching else \
            [(k % 13) + 5 for k in range(8)] + [(i * 7 + k) % 89 + 5 for k in range(w["prompt"])]
        if len(prompt) + w["max_tokens"] > num_blocks * 4:
            continue
        reqs.append(make_req(f"r{i}", len(prompt), w["max_tokens"], arrival=w["arrival"] * 0.004,
                             prompt=prompt, tenant=w["tenant"], slo_ttft_s=w["ttft"],
                             slo_tpot_s=w["tpot"]))
    sim = Sim(sched, reqs, step_time=step_time(cost))
    ctrl = sched.budget_ctrl
    decoding_before: list[set[str]] = []
    real_schedule = sched.schedule

    def schedule(now):
        decoding_before.append({r.request_id for r in sched.running
                                if r.num_uncomputed_tokens == 1})
        return real_schedule(now)

    sched.schedule = schedule
    rejections: list[tuple[str, float]] = []

    def check(sim, out, rec) -> None:
        for rid in decoding_before[-1] - set(out.preempted_req_ids):
            assert out.num_scheduled_tokens.get(rid) == 1, f"decode {rid} stalled"
        priced = ctrl.decode_ids
        unpriced = [rid for rid in out.num_scheduled_tokens if rid not in priced]
        if unpriced and ctrl.limit_s < math.inf:
            assert cost.step_time(batch_shape(out)) <= ctrl.limit_s + 1e-12, (
                f"step {rec.index}: chunks {unpriced} took it past the TPOT limit")

    sim.after_schedule = check
    sim.run()
    for rid, status in sim.statuses.items():
        req = sim.all[rid]
        if status == RequestStatus.FINISHED_REJECTED:
            assert late == "reject" and req.stop_reason == SLO_REJECTED
            assert req.first_scheduled_time is None and req.slo_ttft_s is not None
            # rejected only once it could not make its target even alone
            assert req.finished_time > sched.policy.latest_start(req) - 1e-12
            rejections.append((rid, req.finished_time))
    assert_exact_outputs(sim)
    assert sched.stats.num_slo_rejected == len(rejections)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


# ---- the slo policy's order --------------------------------------------------------------
def test_waiting_requests_go_by_ttft_slack_and_late_ones_last() -> None:
    sched = make_sched(max_num_seqs=1)
    # Same deadline (arrival + ttft = 1.0), different prompt lengths: the longer prompt
    # has less slack. "lost" can no longer make its 0.001 s target; "none" has no target.
    a = make_req("short", 10, 1, slo_ttft_s=1.0)
    b = make_req("long", 1000, 1, slo_ttft_s=1.0)
    lost = make_req("lost", 1000, 1, slo_ttft_s=0.001)
    none = make_req("none", 5, 1)
    order = []
    sim = Sim(sched, [none, lost, a, b], step_time=step_time())
    sim.after_schedule = lambda s, out, rec: order.extend(rec.admitted)
    sim.run()
    assert order == ["long", "short", "lost", "none"]
    assert sched.policy.stats()["num_admitted_late"] == 1


def test_reject_action_refuses_a_request_that_cannot_make_its_ttft() -> None:
    sched = make_sched(policy_config=PolicyConfig(slo_late_action="reject"))
    ok = make_req("ok", 10, 2, slo_ttft_s=1.0)
    lost = make_req("lost", 1000, 2, slo_ttft_s=0.001)
    sim = Sim(sched, [ok, lost], step_time=step_time())
    sim.run()
    assert sim.statuses == {"ok": RequestStatus.FINISHED_LENGTH_CAPPED,
                            "lost": RequestStatus.FINISHED_REJECTED}
    assert lost.stop_reason == SLO_REJECTED and lost.output_token_ids == []
    assert sched.stats.num_slo_rejected == 1 and sched.stats.num_rejected == 1


def test_fair_tie_break_serves_the_least_served_tenant_first_among_ties() -> None:
    """Equal slack within the tie window: slack order interleaves by arrival, the fair
    tie-break lets the light tenant's requests go before the heavy tenant's backlog."""
    def admitted(tie: str) -> list[str]:
        sched = make_sched(max_num_seqs=1, policy_config=PolicyConfig(
            slo_tie_break=tie, slo_tie_quantum_s=10.0))
        reqs = [make_req(f"heavy{i}", 20, 3, arrival=0.0, tenant="heavy", slo_ttft_s=5.0)
                for i in range(6)]
        reqs += [make_req("light0", 20, 3, arrival=0.001, tenant="light", slo_ttft_s=5.0)]
        sim = Sim(sched, reqs, step_time=step_time())
        order = []
        sim.after_schedule = lambda s, out, rec: order.extend(rec.admitted)
        sim.run()
        return order

    assert admitted("slack").index("light0") == 6, "slack order: it arrived last"
    assert admitted("fair").index("light0") == 1, "fair: right after heavy's first"


# ---- flags -------------------------------------------------------------------------------
def test_engine_args_reach_the_scheduler_config() -> None:
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args([
        "--scheduling-policy", "slo", "--slo-late-action", "reject", "--slo-tie-break",
        "fair", "--slo-tie-quantum-ms", "20", "--token-budget", "slo", "--slo-cost-scale",
        "1.2", "--slo-cost-model", "linear:0.002,1e-4,0"]))
    cfg = args.scheduler_config()
    assert (cfg.token_budget, cfg.slo_cost_scale) == ("slo", 1.2)
    assert cfg.policy.slo_late_action == "reject" and cfg.policy.slo_tie_break == "fair"
    assert cfg.policy.slo_tie_quantum_s == pytest.approx(0.02)
    assert args.slo_cost_model == "linear:0.002,1e-4,0"
    with pytest.raises(ValueError, match="slo_late_action"):
        PolicyConfig(slo_late_action="drop")


# ---- metrics -----------------------------------------------------------------------------
def test_summary_reports_ttft_and_tpot_attainment_apart() -> None:
    from conveyor.bench.metrics import RequestRecord, summarize

    def rec(rid, ttft_s, tpot_s, reason="length"):
        return RequestRecord(rid, 0.0, "t", 0, 10, 5, 5, ttft_s=ttft_s, tpot_s=tpot_s,
                             e2e_s=1.0, finish_reason=reason, slo_ttft_ms=100,
                             slo_tpot_ms=10)

    s = summarize([rec("a", 0.05, 0.005), rec("b", 0.5, 0.005), rec("c", 0.05, 0.05),
                   rec("d", None, None, reason="abort")], 2.0)
    assert (s.ttft_attainment, s.tpot_attainment, s.slo_attainment) == (0.5, 0.5, 0.25)
    assert s.goodput == 0.5


def test_the_simulator_reports_the_budget_and_rejections() -> None:
    from sim_helpers import LinearCost, make_workload, tiny_args

    from conveyor.sim import Simulator
    from conveyor.sim.results import run_result

    work = make_workload(40, seed=3)
    # TTFT targets tight enough that some are lost (short prompts pass long prefills, so
    # a looser target is met by all).
    args = tiny_args(scheduling_policy="slo", default_slo_ttft_ms=10.0,
                     default_slo_tpot_ms=3.0, slo_late_action="reject",
                     max_num_batched_tokens=64)
    sim = Simulator(args, LinearCost(0.002, 5e-5), replicas=2)
    result = sim.run(work)
    extra = run_result(work, result, sim).summary.extra
    budget = extra["token_budget"]
    assert budget["mode"] == "slo" and budget["num_steps"] == result.num_steps
    assert sum(budget["histogram"].values()) == budget["num_steps"]
    assert extra["num_slo_rejected"] == sum(
        1 for why in result.finished.values() if why.finish_reason == "abort")
    assert extra["num_slo_rejected"] > 0 and budget["num_time_bound"] > 0
