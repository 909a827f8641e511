"""Long prefills share each step with short prompts (core/prefill_split.py), on a virtual
clock with a fake runner: short prompts are not held behind a long prefill, the long
prefill keeps its guaranteed share, the caps hold and every request finishes."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_harness import Sim, StepRecord, make_req

from conveyor.config import PolicyConfig, SchedulerConfig

from helpers import make_scheduler

BUDGET = 32
LONG = 400  # prompt tokens: 13 steps of BUDGET alone


def sched(policy: str = "fcfs", **kwargs):
    kwargs.setdefault("num_blocks", 1024)
    kwargs.setdefault("max_num_batched_tokens", BUDGET)
    kwargs.setdefault("max_num_seqs", 16)
    return make_scheduler(scheduling_policy=policy, policy=PolicyConfig(), **kwargs)


def long_with_shorts(num_long: int = 1, every: float = 2.0, num_short: int = 8) -> list:
    """Long prompts at t=0, short ones arriving every ``every`` steps from t=1 (one
    priority class: priority would pause the long prefill for more urgent ones)."""
    reqs = [make_req(f"long{i}", LONG, 2, arrival=0.0, priority=1) for i in range(num_long)]
    reqs += [make_req(f"s{i}", 6, 3, arrival=1.0 + every * i, priority=1, slo_ttft_s=2.0)
             for i in range(num_short)]
    for r in reqs[:num_long]:
        r.slo_ttft_s = 1000.0
    return reqs


def ttft(req) -> float:
    return req.first_token_time - req.arrival_time


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "slo", "fair", "lpm", "edf", "priority"])
def test_short_prompts_pass_a_long_prefill(policy):
    """Each short prompt's first token comes within two steps of its arrival, and the long
    prompt's TTFT stays within 1 / share of its steps alone (the stated bound)."""
    sim = Sim(sched(policy), long_with_shorts())
    sim.run()
    alone = math.ceil(LONG / BUDGET)
    for rid, req in sim.all.items():
        if rid.startswith("s"):
            assert ttft(req) <= 2.0, (rid, ttft(req))
    # Decodes of the shorts take a token each from the budget before the split.
    assert ttft(sim.all["long0"]) <= math.ceil(LONG / math.ceil(0.5 * (BUDGET - 8))), \
        ttft(sim.all["long0"])
    assert ttft(sim.all["long0"]) < 2 * alone


def test_without_a_share_for_short_prompts_they_wait_for_the_whole_prefill():
    """The failure the split fixes: a long prefill served before everyone else (share 1)."""
    sim = Sim(sched("fcfs", long_prefill_min_share=1.0), long_with_shorts())
    sim.run()
    assert ttft(sim.all["s0"]) >= LONG // BUDGET - 2


def test_several_long_prompts_advance_one_at_a_time_and_shorts_pass():
    # Several partial prefills allowed: the queued long prompts are admitted paused.
    sim = Sim(sched("fcfs", max_num_partial_prefills=4),
              long_with_shorts(num_long=3, every=1.0))
    long_partials: list[int] = []

    def count(s: Sim, out, rec: StepRecord) -> None:
        # A long prefill whose chunk does not end it (one ending this step is no partial).
        long_partials.append(sum(
            1 for rid, n in out.num_scheduled_tokens.items()
            if s.all[rid].num_computed_tokens < s.all[rid].num_tokens
            and s.all[rid].num_tokens - (s.all[rid].num_computed_tokens - n) > BUDGET))

    sim.after_schedule = count
    sim.run()
    assert max(long_partials) == 1
    for rid, req in sim.all.items():
        if rid.startswith("s"):
            assert ttft(req) <= 2.0, (rid, ttft(req))
    # fcfs: the long prompts end in arrival order, and none waits on a paused one forever.
    ends = [sim.all[f"long{i}"].first_token_time for i in range(3)]
    assert ends == sorted(ends)
    assert sim.sched.stats.num_paused_prefills >= 2
    assert sim.sched.stats.prefill_paused_s > 0
    assert sim.all["long2"].prefill_paused_s > 0


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "fair", "sjf", "slo"])
def test_short_prompts_pass_queued_long_prompts_at_the_defaults(policy):
    """Several long prompts at once, default caps (one partial prefill): the long prompts
    that cannot start yet stay queued, but the short prompts behind them are not held
    back by them (fcfs: they go through beside the oldest prefill), and the long prompts
    still start and end in arrival order."""
    sim = Sim(sched(policy), long_with_shorts(num_long=3, every=1.0))
    sim.run()
    for rid, req in sim.all.items():
        if rid.startswith("s"):
            assert ttft(req) <= 2.0, (rid, ttft(req))
    starts = [sim.all[f"long{i}"].first_scheduled_time for i in range(3)]
    ends = [sim.all[f"long{i}"].first_token_time for i in range(3)]
    assert starts == sorted(starts) and ends == sorted(ends)
    assert sim.sched.stats.num_paused_prefills == 0  # none was admitted paused


def test_priority_pauses_a_long_prefill_without_recompute():
    """An urgent arrival takes the whole step; the long prefill keeps its blocks."""
    sim = Sim(sched("priority", max_num_batched_tokens=16),
              [make_req("long", LONG, 2, arrival=0.0, priority=1),
               make_req("urgent", 16, 2, arrival=3.0, priority=0)])
    computed_before: dict[int, int] = {}

    def watch(s: Sim, out, rec: StepRecord) -> None:
        computed_before[rec.index] = s.all["long"].num_computed_tokens

    sim.after_schedule = watch
    steps = sim.run()
    urgent_step = next(r for r in steps if "urgent" in r.out.num_scheduled_tokens)
    assert urgent_step.out.num_scheduled_tokens["urgent"] == 16
    assert "long" not in urgent_step.out.num_scheduled_tokens  # paused
    assert sim.sched.stats.num_preemptions == 0  # nothing recomputed
    assert ttft(sim.all["urgent"]) == 1.0
    # Under fcfs the long prefill keeps half the step instead (two partial prefills).
    sim = Sim(sched("fcfs", max_num_batched_tokens=16, max_num_partial_prefills=2),
              [make_req("long", LONG, 2, arrival=0.0, priority=1),
               make_req("urgent", 16, 2, arrival=3.0, priority=0)])
    steps = sim.run()
    step = next(r for r in steps if "urgent" in r.out.num_scheduled_tokens)
    assert step.out.num_scheduled_tokens["long"] == 8


def test_lpm_cache_miss_is_served_within_its_overtake_bound():
    """A cache miss among a stream of hits is admitted after at most lpm_window overtakes."""
    window = 3
    shared = list(range(5, 37))  # 32 tokens: 8 cached blocks
    reqs = [make_req("warm", 32, 1, arrival=0.0, prompt=shared)]
    reqs.append(make_req("miss", 40, 1, arrival=2.0))
    reqs += [make_req(f"hit{i}", 36, 1, arrival=2.0, prompt=shared + [90 + i] * 4)
             for i in range(8)]
    s = make_scheduler(scheduling_policy="lpm", policy=PolicyConfig(lpm_window=window),
                       num_blocks=256, max_num_batched_tokens=8, max_num_seqs=1,
                       enable_prefix_caching=True)
    sim = Sim(s, reqs)
    sim.run()
    order = sorted(sim.all, key=lambda rid: sim.all[rid].first_scheduled_time)
    assert order.index("miss") <= 1 + window


def test_config_checks():
    with pytest.raises(ValueError, match="max_long_partial_prefills"):
        SchedulerConfig(max_num_partial_prefills=2, max_long_partial_prefills=3)
    with pytest.raises(ValueError, match="long_prefill_min_share"):
        SchedulerConfig(long_prefill_min_share=0.0)
    with pytest.raises(ValueError, match="max_num_partial_prefills"):
        SchedulerConfig(max_num_partial_prefills=0)
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    assert SchedulerConfig(max_num_batched_tokens=100).long_prefill_threshold == 100
    assert SchedulerConfig(long_prefill_token_threshold=7).long_prefill_threshold == 7


# ---- properties --------------------------------------------------------------------------
workloads = st.lists(
    st.fixed_dictionaries({
        "prompt": st.one_of(st.integers(1, 12), st.integers(30, 120)),
        "max_tokens": st.integers(1, 6), "arrival": st.integers(0, 20),
        "priority": st.integers(0, 2), "ttft": st.one_of(st.none(), st.integers(1, 30)),
    }),
    min_size=1, max_size=16)


@settings(max_examples=40, deadline=None)
@given(workload=workloads,
       policy=st.sampled_from(["fcfs", "sjf", "slo", "fair", "lpm", "edf", "priority"]),
       max_partial=st.integers(1, 3), max_long=st.integers(1, 3),
       share=st.sampled_from([0.25, 0.5, 1.0]), threshold=st.sampled_from([0, 8]),
       num_blocks=st.sampled_from([48, 512]))
def test_caps_share_and_completion(workload, policy, max_partial, max_long, share, threshold,
                                   num_blocks):
    """Per step: the budget, at most max_num_partial_prefills partial prefills, of them at
    most max_long_partial_prefills long; the first long prefill that was running gets at
    least its share of what the decodes left (steps without preemption; priority may
    waive it for a more urgent arrival); every request finishes."""
    max_long = min(max_long, max_partial)
    budget = 16
    s = make_scheduler(scheduling_policy=policy, policy=PolicyConfig(), num_blocks=num_blocks,
                       max_num_batched_tokens=budget, max_num_seqs=6,
                       max_num_partial_prefills=max_partial, max_long_partial_prefills=max_long,
                       long_prefill_token_threshold=threshold, long_prefill_min_share=share,
                       max_model_len=160)
    reqs = [make_req(f"r{i}", w["prompt"], w["max_tokens"], arrival=float(w["arrival"]),
                     priority=w["priority"],
                     slo_ttft_s=None if w["ttft"] is None else float(w["ttft"]))
            for i, w in enumerate(workload)]
    sim = Sim(s, reqs)
    limit = threshold or budget
    left_before: dict[str, int] = {}
    running_before: list[str] = []
    preemptions = [s.stats.num_preemptions]

    def check(sim_: Sim, out, rec: StepRecord) -> None:
        scheduled = out.num_scheduled_tokens
        partial = long_ = 0
        for rid, n in scheduled.items():
            req = sim_.all[rid]
            left = req.num_tokens - (req.num_computed_tokens - n)
            if n < left:
                partial += 1
                long_ += left > limit
        assert partial <= max_partial, (rec.index, scheduled)
        assert long_ <= max_long, (rec.index, scheduled)
        preempted = s.stats.num_preemptions != preemptions[0]
        preemptions[0] = s.stats.num_preemptions
        longs = [rid for rid in running_before
                 if left_before.get(rid, 0) > max(limit, 1) and rid in sim_.all
                 and sim_.all[rid].status.name == "RUNNING"]
        if longs and not preempted and policy != "priority":
            decode_tokens = sum(n for rid, n in scheduled.items()
                                if left_before.get(rid, 0) == 1)
            want = math.ceil(share * (budget - decode_tokens))
            best = max(scheduled.get(rid, 0) for rid in longs)
            assert best >= min(want, min(left_before[rid] for rid in longs)), \
                (rec.index, scheduled, longs, want)

    def before_step() -> None:
        running_before[:] = [r.request_id for r in s.running]
        left_before.clear()
        left_before.update({r.request_id: r.num_uncomputed_tokens for r in s.running})

    sim.after_schedule = check
    while True:
        before_step()
        if sim.step() is None:
            break
        assert len(sim.steps) < 5000
    assert not s.has_unfinished() and not sim.pending


# ---- the command line ----------------------------------------------------------------------
def test_cli_flags_reach_the_scheduler_config():
    import argparse

    from conveyor.config import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--max-num-partial-prefills", "3",
                              "--max-long-partial-prefills", "2",
                              "--long-prefill-token-threshold", "1000",
                              "--long-prefill-min-share", "0.25"])
    cfg = EngineArgs.from_cli_args(args).scheduler_config()
    assert (cfg.max_num_partial_prefills, cfg.max_long_partial_prefills,
            cfg.long_prefill_token_threshold, cfg.long_prefill_min_share) == (3, 2, 1000, 0.25)
    default = EngineArgs().scheduler_config()
    assert (default.max_num_partial_prefills, default.max_long_partial_prefills,
            default.long_prefill_min_share) == (1, 1, 0.5)


@pytest.mark.parametrize("flags, message", [
    (["--max-num-partial-prefills", "4", "--max-long-partial-prefills", "5"],
     "max_long_partial_prefills must be >= 1 and <="),
    (["--long-prefill-min-share", "1.5"], "long_prefill_min_share must be in (0, 1]"),
    (["--max-num-partial-prefills", "0"], "max_num_partial_prefills must be >= 1"),
])
def test_bad_flags_are_clear_errors(flags, message, capsys):
    from conveyor.entrypoints.cli import main

    rc = main(["sim", "--model", "llama3-8b", "--workload", "conversation", "--num-requests",
               "4", *flags])
    assert rc == 2 and message in capsys.readouterr().err
