"""Starvation bounds on a virtual clock (one step = 1 s): ``sjf`` at its defaults (the
overtake bound) and with linear aging admits a long prompt under a stream of short ones
within its bound (without either, never while the stream lasts), and ``lpm`` at its
default window admits a cache miss among a stream of hits within its overtake bound."""

from __future__ import annotations

import math

import pytest
from policy_harness import Sim, make_req

from conveyor.config import PolicyConfig

from helpers import make_scheduler

MAX_MODEL_LEN = 512


def short_stream(num: int, start: float = 0.0) -> list:
    """Short requests (4-token prompts, 4 output tokens), one a step: more than two
    sequence slots serve, so a queue of shorter work than a long prompt's never empties."""
    return [make_req(f"s{i}", 4, 4, arrival=start + i) for i in range(num)]


def sjf_run(aging_s: float, num_short: int) -> Sim:
    policy = PolicyConfig(sjf_aging_s=aging_s, sjf_overtake_factor=0.0)
    sched = make_scheduler(scheduling_policy="sjf", policy=policy, num_blocks=1024,
                           max_num_seqs=2, max_num_batched_tokens=32,
                           max_model_len=MAX_MODEL_LEN)
    # The long prompt arrives with the second short one (the first holds a slot).
    sim = Sim(sched, [make_req("long", 100, 2, arrival=1.0)] + short_stream(num_short))
    sim.run()
    return sim


@pytest.mark.parametrize("aging", [10.0, 60.0])
def test_sjf_aging_serves_a_long_prompt_within_its_bound(aging):
    """No request that arrived ``sjf_aging_s`` or more after the long prompt is admitted
    before it, so the long prompt starts while the stream goes on."""
    # Shorts (work 8) overtake the long prompt (work 102) for aging * (102 - 8) / 512 s;
    # the stream goes on well past that.
    num_short = math.ceil(aging * (102 - 8) / MAX_MODEL_LEN) + 30
    sim = sjf_run(aging, num_short)
    long_ = sim.all["long"]
    before = [r for rid, r in sim.all.items()
              if rid != "long" and r.first_scheduled_time < long_.first_scheduled_time]
    assert before, "the shorts should go first for a while"
    assert all(r.arrival_time < long_.arrival_time + aging for r in before)
    last_arrival = max(r.arrival_time for r in sim.all.values())
    assert long_.first_scheduled_time < last_arrival  # not after the stream ended


def test_sjf_without_aging_starves_a_long_prompt_for_the_whole_stream():
    """The failure aging prevents: with ``sjf_aging_s=0`` the long prompt waits until the
    stream of shorter work is over."""
    sim = sjf_run(0.0, 80)
    long_ = sim.all["long"]
    shorts = [r for rid, r in sim.all.items() if rid != "long"]
    assert all(r.first_scheduled_time < long_.first_scheduled_time for r in shorts[:-3])


def stream_run(config: PolicyConfig, num_short: int) -> Sim:
    """A 60-token prompt (work 61) among 40-token ones (work 41), eight arriving a step
    while at most six start: shorter work waits all along."""
    sched = make_scheduler(scheduling_policy="sjf", policy=config, num_blocks=4096,
                           max_num_seqs=8, max_num_batched_tokens=256,
                           max_model_len=MAX_MODEL_LEN)
    reqs = [make_req("long", 60, 1, arrival=0.5)]
    reqs += [make_req(f"s{i}", 40, 1, arrival=float(i // 8)) for i in range(num_short)]
    sim = Sim(sched, reqs, check=False)
    sim.run(max_steps=100_000)
    return sim


def work_ahead(sim: Sim, rid: str) -> float:
    """Work (as sjf counts it) admitted between ``rid`` joining the queue and its start."""
    ahead, joined = 0.0, False
    for step in sim.steps:
        joined = joined or step.start >= sim.all[rid].arrival_time
        for other in step.admitted if joined else ():
            if other == rid:
                return ahead
            req = sim.all[other]
            ahead += req.num_prompt_tokens - req.num_cached_tokens + req.max_tokens
    raise AssertionError(f"{rid} never started")


def test_sjf_default_overtake_bound_serves_a_long_prompt_among_a_stream():
    """At the defaults, at most ``sjf_overtake_factor`` times the long prompt's work (61)
    is admitted ahead of it, plus the one admission that makes it overdue, although
    shorter work waits all along; it starts while the stream still arrives."""
    config = PolicyConfig()
    factor = config.sjf_overtake_factor
    assert factor > 0, "the bound is on by default"
    sim = stream_run(config, 2 * math.ceil(factor * 61 / 41) + 200)
    ahead = work_ahead(sim, "long")
    assert ahead > 0.5 * factor * 61, "shorter work goes first for a while"
    assert ahead <= factor * 61 + 41
    last_arrival = max(r.arrival_time for r in sim.all.values())
    assert sim.all["long"].first_scheduled_time < last_arrival - 10


def test_sjf_without_the_overtake_bound_starves_the_long_prompt():
    """The failure the bound prevents: with it off, the same kind of stream passes the
    long prompt until no shorter work is left."""
    sim = stream_run(PolicyConfig(sjf_overtake_factor=0.0), 600)
    last_arrival = max(r.arrival_time for r in sim.all.values())
    assert sim.all["long"].first_scheduled_time >= last_arrival


@pytest.mark.parametrize("window", [None, 4])
def test_lpm_serves_a_cache_miss_among_hits_within_its_overtake_bound(window):
    """A stream of requests sharing a cached prefix and one cache miss among them: at most
    ``lpm_window`` (default 64) requests that arrived after the miss are admitted before
    it, whatever keeps arriving."""
    policy = PolicyConfig() if window is None else PolicyConfig(lpm_window=window)
    limit = policy.lpm_window
    shared = list(range(5, 37))  # 32 tokens: 8 blocks of 4
    reqs = [make_req("warm", 32, 1, arrival=0.0, prompt=shared)]
    reqs += [make_req(f"hit{i}", 36, 1, arrival=2.0 + 0.5 * i, prompt=shared + [90 + i] * 4)
             for i in range(2 * limit + 20)]
    miss = make_req("miss", 40, 1, arrival=2.25)  # arrives among the hits, a few behind it
    sched = make_scheduler(scheduling_policy="lpm", policy=policy, num_blocks=1024,
                           max_num_seqs=1, max_num_batched_tokens=8,
                           enable_prefix_caching=True)
    sim = Sim(sched, reqs + [miss])
    sim.run()
    miss_start = sim.all["miss"].first_scheduled_time
    overtook = [rid for rid, r in sim.all.items()
                if r.arrival_time > miss.arrival_time and r.first_scheduled_time < miss_start]
    assert overtook, "hits should overtake the miss while the bound allows"
    assert len(overtook) <= limit
    assert miss_start < max(r.arrival_time for r in sim.all.values())
