"""Capacity search over simulated runs on a small case."""

from __future__ import annotations

import itertools

import pytest
from sim_helpers import LinearCost, make_workload, tiny_args

from conveyor.outputs import RequestMetrics
from conveyor.sim import SLO, Simulator, find_max_rate, find_min_replicas
from conveyor.sim.capacity import at_rate, run_probe, slo_attainment

ARGS = tiny_args(num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=128)
COST = LinearCost(per_step=0.01, per_token=0.0005)
SLO_ = SLO(ttft_s=0.25, tpot_s=0.05, attainment=0.9)


def workload():
    return make_workload(60, seed=7, mean_gap_s=0.01, prompt_range=(16, 96),
                         output_range=(4, 16))


def attainment(replicas: int) -> float:
    w = workload()
    return slo_attainment(Simulator(ARGS, COST, replicas=replicas,
                                    router="least_loaded").run(w), SLO_, len(w))


def test_slo_membership():
    m = RequestMetrics(arrival_time=0.0, first_token_time=0.2, last_token_time=0.5,
                       num_generation_tokens=4, finish_reason="length")
    assert SLO(ttft_s=0.2, tpot_s=0.1).met_by(m)  # TPOT (0.5-0.2)/3 = 0.1
    assert not SLO(ttft_s=0.19).met_by(m)
    assert not SLO(tpot_s=0.09).met_by(m)
    m.finish_reason = "abort"
    assert not SLO(ttft_s=1.0).met_by(m)
    with pytest.raises(ValueError, match="TTFT or a TPOT"):
        SLO()
    with pytest.raises(ValueError, match="attainment"):
        SLO(ttft_s=1.0, attainment=0.0)


def test_min_replicas_is_the_smallest_count_that_meets_the_slo():
    found = find_min_replicas(workload(), ARGS, COST, SLO_, max_replicas=16)
    n = found.value
    assert n is not None and n > 1  # one replica cannot keep up with this workload
    # Checked independently with full runs (no early stop): n meets the target, n-1 misses.
    assert attainment(n) >= 0.9 > attainment(n - 1)
    assert {p.value for p in found.probes} >= {n, n - 1}
    assert found.failing == n - 1


def test_min_replicas_reports_none_when_out_of_reach():
    impossible = SLO(ttft_s=0.001, attainment=0.99)  # below one step's time
    found = find_min_replicas(workload(), ARGS, COST, impossible, max_replicas=4)
    assert found.value is None
    assert [p.value for p in found.probes] == [1, 2, 4]
    assert all(p.stopped_early for p in found.probes)  # each probe gave up early


def test_max_rate_is_bracketed_within_tolerance():
    w = workload()
    found = find_max_rate(w, ARGS, COST, SLO_, rel_tol=0.05)
    rate = found.value
    assert rate is not None

    def meets(r: float) -> bool:
        scaled = at_rate(w, r)
        return slo_attainment(Simulator(ARGS, COST).run(scaled), SLO_, len(w)) >= 0.9

    assert meets(rate)
    missed = [p.value for p in found.probes if not p.meets]
    assert missed and found.failing == min(missed) <= rate * 1.05 + 1e-9
    assert not meets(found.failing)


def test_at_rate_rescales_gaps_and_keeps_the_pattern():
    w = workload()
    scaled = at_rate(w, 50.0)
    span = scaled[-1].arrival_s - scaled[0].arrival_s
    assert (len(w) - 1) / span == pytest.approx(50.0)
    gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(w)]
    new_gaps = [b.arrival_s - a.arrival_s for a, b in itertools.pairwise(scaled)]
    ratio = new_gaps[0] / gaps[0]
    assert all(ng == pytest.approx(g * ratio) for g, ng in zip(gaps, new_gaps))
    assert [s.prompt_token_ids for s in scaled] == [x.prompt_token_ids for x in w]


def test_a_probe_stops_once_the_target_is_lost():
    sim = Simulator(ARGS, COST)
    probe = run_probe(sim, workload(), SLO(ttft_s=0.001, attainment=0.9), 1)
    assert probe.stopped_early and not probe.meets


def test_the_search_keeps_the_run_at_its_answer_only():
    w = workload()
    found = find_min_replicas(w, ARGS, COST, SLO_, max_replicas=16)
    assert found.result is not None and not found.result.stopped_early
    again = Simulator(ARGS, COST, replicas=found.value, router="least_loaded").run(w)
    assert found.result.finished == again.finished
    assert [p.value for p in found.probes if p.result is not None] == [found.value]
    rated = find_max_rate(w, ARGS, COST, SLO_, rel_tol=0.05)
    assert [p.value for p in rated.probes if p.result is not None] == [rated.value]
    scaled = Simulator(ARGS, COST).run(at_rate(w, rated.value))
    assert rated.result.finished == scaled.finished
