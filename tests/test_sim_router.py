"""Routers on small cases, and replicas as independent engines on one clock."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from sim_helpers import LinearCost, make_workload, tiny_args

from conveyor.bench.workload import BenchRequest
from conveyor.sim import Simulator, make_router


@dataclass
class Load:
    num_unfinished: int


def test_round_robin_takes_turns_whatever_the_load():
    router = make_router("round_robin")
    loads = [Load(9), Load(0), Load(0)]
    assert [router.route([1, 2, 3], loads) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_picks_the_fewest_unfinished_lowest_index_on_ties():
    router = make_router("least_loaded")
    assert router.route([1], [Load(3), Load(1), Load(1)]) == 1
    assert router.route([1], [Load(0), Load(0)]) == 0
    assert router.route([1], [Load(5), Load(4), Load(7), Load(2)]) == 3


def test_prefix_affinity_follows_the_longest_shared_prefix():
    router = make_router("prefix_affinity")  # chunks of 64 tokens
    a = list(range(100, 300))  # 200 tokens: 3 full chunks
    b = list(range(1000, 1200))
    loads = [Load(0), Load(0), Load(0)]
    assert router.route(a, loads) == 0  # unseen: least loaded
    loads[0].num_unfinished = 1
    assert router.route(b, loads) == 1  # unseen: least loaded
    loads[1].num_unfinished = 1
    # Prompts sharing a's first two chunks go to 0, even though 2 is idle.
    assert router.route(a[:128] + [7] * 50, loads) == 0
    # Sharing less than one whole chunk is no affinity.
    assert router.route(a[:63] + [8] * 100, loads) == 2


def test_prefix_affinity_gives_way_when_replicas_are_out_of_balance():
    router = make_router("prefix_affinity")
    a = list(range(100, 300))
    assert router.route(a, [Load(0), Load(0)]) == 0
    # 0 has 9 more requests than 1 and more than 1.5 times as many: balance wins.
    assert router.route(a, [Load(10), Load(1)]) == 1
    # Within the thresholds affinity wins again (and now points at 1, the last taker).
    assert router.route(a, [Load(4), Load(3)]) == 1


def test_unknown_router_lists_the_valid_ones():
    with pytest.raises(ValueError, match="least_loaded, prefix, prefix_affinity, round_robin"):
        make_router("random")
    with pytest.raises(ValueError, match="valid routers"):
        Simulator(tiny_args(num_kv_blocks=64), LinearCost(), router="random")


def test_replicas_are_independent_engines_on_one_clock():
    """With round robin, each replica's requests see exactly what one engine alone would."""
    args = tiny_args(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    work = make_workload(30, seed=3, mean_gap_s=0.004)
    both = Simulator(args, LinearCost(0.005, 0.0002), replicas=2).run(work)
    assert {both.replica_of[w.request_id] for w in work} == {0, 1}
    for r in (0, 1):
        part = [w for w in work if both.replica_of[w.request_id] == r]
        alone = Simulator(args, LinearCost(0.005, 0.0002)).run(part)
        for w in part:
            a, b = alone.finished[w.request_id], both.finished[w.request_id]
            assert (a.first_token_time, a.token_times, a.finished_time) == \
                (b.first_token_time, b.token_times, b.finished_time)
    assert [w.request_id for w in work if both.replica_of[w.request_id] == 0] == \
        [w.request_id for w in work[::2]]


def test_least_loaded_spreads_a_burst_and_beats_one_replica():
    args = tiny_args(num_kv_blocks=256, max_num_seqs=4, max_num_batched_tokens=256)
    burst = make_workload(24, seed=4, mean_gap_s=0.0)
    one = Simulator(args, LinearCost()).run(burst)
    three = Simulator(args, LinearCost(), replicas=3, router="least_loaded").run(burst)
    counts = [s.num_requests for s in three.replicas]
    assert counts == [8, 8, 8]  # simultaneous arrivals: each goes to the emptiest
    assert three.sim_time < one.sim_time


def test_prefix_affinity_raises_the_prefix_hit_rate():
    """Two prompt families: affinity keeps each on one replica, round robin mixes them."""
    args = tiny_args(num_kv_blocks=512, max_num_seqs=8, max_num_batched_tokens=512)
    fam = [list(range(10, 266)), list(range(500, 756))]  # 256 shared tokens each
    work = [BenchRequest(f"r{i}", i * 0.05, fam[(i // 2) % 2] + [900 + i] * 5, 4)
            for i in range(24)]
    hit = {}
    for router in ("round_robin", "prefix_affinity", "prefix"):
        res = Simulator(args, LinearCost(), replicas=2, router=router).run(work)
        hit[router] = sum(m.num_cached_tokens for m in res.metrics)
        if router == "prefix":  # each family on one replica
            for f in range(2):
                assert len({res.replica_of[w.request_id] for i, w in enumerate(work)
                            if (i // 2) % 2 == f}) == 1
    assert hit["prefix_affinity"] > hit["round_robin"]
    assert hit["prefix"] > hit["round_robin"]


def test_prefix_router_counts_prompts_routed_but_not_yet_cached():
    """A burst of one family at one instant: nothing is cached yet when the second
    arrives, but the router knows where the first went and sends it there too, until
    that replica is overloaded (SGLang's thresholds: 8 requests and 1.5x above the least
    loaded), when it spills to the other."""
    args = tiny_args(num_kv_blocks=512, max_num_seqs=8, max_num_batched_tokens=512)
    shared = list(range(10, 266))
    work = [BenchRequest(f"r{i}", 0.0, shared + [900 + i] * 5, 4) for i in range(12)]
    res = Simulator(args, LinearCost(), replicas=2, router="prefix").run(work)
    where = [res.replica_of[w.request_id] for w in work]
    assert where[:10] == [0] * 9 + [1]
