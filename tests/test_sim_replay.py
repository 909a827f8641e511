"""The simulator drives the real scheduler: replaying a real run's step times reproduces it.

A real engine (the tiny dummy model on this CPU) runs a workload with a clock that
counts only the time spent inside steps, so that step k's update time is step k+1's
start (or the next arrival, when the engine idles). Its steps (start, end, batch)
are recorded by wrapping its scheduler; the simulator then runs the same workload
with a cost model that returns those step durations. Every step's batch, and every
request's metrics, must come out identical.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Callable

import pytest
from sim_helpers import TICK, make_workload, on_grid, tiny_args

from conveyor.bench.workload import BenchRequest
from conveyor.core.policies import POLICIES
from conveyor.engine.llm_engine import LLMEngine
from conveyor.outputs import RequestMetrics
from conveyor.sampling_params import SamplingParams
from conveyor.sim import ReplayCostModel, Simulator, StepRecorder


class StepClock:
    """An engine clock that runs only inside steps, on the TICK grid.

    ``LLMEngine.step`` reads its clock twice: before schedule() and before update().
    The first read returns the held time and starts a stopwatch; the second returns
    the held time plus the wall time since, and holds it. ``advance_to`` moves the
    held time forward while the engine idles.

    With ``step_cost`` the step's duration is that function's answer instead of the wall
    time (a model clock: the run then does not depend on the machine's speed).
    """

    def __init__(self, step_cost: Callable[[], float] | None = None) -> None:
        self.now = 0.0
        self._since: float | None = None
        self.step_cost = step_cost

    def __call__(self) -> float:
        if self._since is None:
            self._since = time.perf_counter()
            return self.now
        elapsed = time.perf_counter() - self._since
        if self.step_cost is not None:
            elapsed = self.step_cost()
        self._since = None
        self.now = max(on_grid(self.now + elapsed), self.now + TICK)
        return self.now

    def advance_to(self, t: float) -> None:
        assert self._since is None
        self.now = max(self.now, t)


def run_real(args, work: list[BenchRequest], model_clock: bool = False):
    clock = StepClock()
    engine = LLMEngine(args, clock=clock)
    pending = deque(sorted(work, key=lambda w: w.arrival_s))

    def arrive(now: float) -> None:  # at the moment the scheduler looks, as in the simulator
        while pending and pending[0].arrival_s <= now:
            w = pending.popleft()
            engine.add_request(w.prompt_token_ids,
                               SamplingParams(max_tokens=w.output_len, temperature=0.0,
                                              ignore_eos=True),
                               request_id=w.request_id, arrival_time=w.arrival_s,
                               priority=w.priority, tenant=w.tenant,
                               slo_ttft_ms=w.slo_ttft_ms, slo_tpot_ms=w.slo_tpot_ms)

    recorder = StepRecorder(engine.scheduler, before_schedule=arrive)
    if model_clock:  # 2 ms a step + 0.1 ms a token: requests pile up on any machine
        clock.step_cost = lambda: 0.002 + 1e-4 * recorder.in_progress.total_num_scheduled_tokens
    metrics: dict[str, RequestMetrics] = {}
    while pending or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            clock.advance_to(pending[0].arrival_s)
        for out in engine.step():
            if out.finished:
                metrics[out.request_id] = out.metrics
    return recorder.records, metrics, engine.stats()


def run_sim(args, work: list[BenchRequest], durations: list[float]):
    sim = Simulator(args, ReplayCostModel(durations))
    steps = []
    sim.step_listeners.append(
        lambda r, start, end, out: steps.append((start, end, dict(out.num_scheduled_tokens))))
    return sim.run(work), steps


def _workload() -> list[BenchRequest]:
    # Two waves with an idle gap between them; prompts share prefixes but none repeats
    # whole: the dummy model's greedy tokens can differ between two copies of a prompt
    # computed in different batches (near-tie logits), and a preempted copy would then
    # find its twin's output blocks in the simulator's prefix cache but not in the engine's.
    first = make_workload(18, seed=1, shared_prefix=32, repeat_every=0)
    second = make_workload(14, seed=2, shared_prefix=32, start=first[-1].arrival_s + 5.0,
                           repeat_every=0)
    return first + [BenchRequest(f"s{w.request_id}", w.arrival_s, w.prompt_token_ids, w.output_len,
                             w.tenant, w.priority, w.slo_ttft_ms, w.slo_tpot_ms)
                    for w in second]


# A pool of 40 blocks of 16 tokens for up to 6 sequences of up to ~190 tokens forces
# preemptions; a 48-token budget forces chunked prefills.
CASES = [
    pytest.param(dict(scheduling_policy=name), id=name) for name in sorted(POLICIES)
] + [
    pytest.param(dict(scheduling_policy="edf", default_slo_ttft_ms=30.0,
                      default_slo_tpot_ms=8.0), id="edf-default-slos",
                 marks=pytest.mark.skipif("edf" not in POLICIES, reason="no edf policy")),
    # The SLO budget controller prices every step with the same linear model in the engine
    # and in the simulator (a replayed cost cannot answer its "what if" questions).
    pytest.param(dict(scheduling_policy="slo", default_slo_ttft_ms=30.0,
                      default_slo_tpot_ms=4.0, slo_cost_model="linear:0.002,1e-4,0"),
                 id="slo-controller"),
    pytest.param(dict(scheduling_policy="slo", default_slo_ttft_ms=30.0,
                      default_slo_tpot_ms=4.0, slo_cost_model="linear:0.002,1e-4,0",
                      slo_late_action="reject"), id="slo-reject"),
    pytest.param(dict(scheduling_policy="fcfs", batching="static"), id="fcfs-static"),
    pytest.param(dict(scheduling_policy="fcfs", enable_prefix_caching=False,
                      enable_chunked_prefill=False, max_num_batched_tokens=256),
                 id="fcfs-no-prefix-no-chunk"),
]


# "wall": the real step times of this machine; "model": a model clock, whose run preempts,
# chunks and hits the cache on any machine (guarded by the test below).
@pytest.mark.parametrize("clock", ["wall", "model"])
@pytest.mark.parametrize("overrides", CASES)
def test_replayed_step_times_reproduce_every_batch(overrides, clock):
    args = tiny_args(**{**dict(num_kv_blocks=40, max_num_seqs=6, max_num_batched_tokens=48),
                        **overrides})
    work = _workload()
    records, real_metrics, real_stats = run_real(args, work, model_clock=clock == "model")
    result, sim_steps = run_sim(args, work, [r.duration for r in records])

    assert len(real_metrics) == len(work)
    assert [(r.start, r.end, r.batch) for r in records] == sim_steps
    assert not result.errors and not result.unfinished
    assert set(result.finished) == set(real_metrics)
    for rid, real in real_metrics.items():
        sim = result.finished[rid]
        for field in dataclasses.fields(RequestMetrics):  # every one, current and future
            assert getattr(sim, field.name) == getattr(real, field.name), (rid, field.name)
    assert result.replicas[0].num_preemptions == real_stats["num_preemptions"]
    assert result.num_steps == len(records)
    if "slo_cost_model" in overrides and clock == "model":  # (wall: any machine's speed)
        assert real_stats["token_budget"]["num_time_bound"] > 0, "the controller should cut"
        if overrides.get("slo_late_action") == "reject":
            assert real_stats["num_slo_rejected"] > 0


def test_the_replay_scenario_exercises_the_interesting_decisions():
    """Guards the test above: its workload must preempt, chunk, hit the prefix cache, idle.

    On a model clock, so that it holds however fast this machine runs the tiny model (the
    test above replays real step times; on a fast enough CPU it may preempt less)."""
    args = tiny_args(num_kv_blocks=40, max_num_seqs=6, max_num_batched_tokens=48)
    work = _workload()
    records, real_metrics, stats = run_real(args, work, model_clock=True)
    prompt_len = {w.request_id: len(w.prompt_token_ids) for w in work}
    assert stats["num_preemptions"] > 0
    assert any(1 < n < prompt_len[rid] for r in records for rid, n in r.batch.items())
    assert any(m.num_cached_tokens > 0 for m in real_metrics.values())
    gaps = [b.start - a.end for a, b in itertools.pairwise(records)]
    assert max(gaps) > 1.0  # the engine idled between the two waves
    assert sum(1 for g in gaps if g == 0) > len(gaps) // 2  # otherwise steps are back to back


def test_a_wrong_step_time_changes_the_batches():
    """The comparison can fail: replaying other durations gives other batches."""
    args = tiny_args(num_kv_blocks=40, max_num_seqs=6, max_num_batched_tokens=48)
    work = _workload()
    records, _, _ = run_real(args, work)
    # Steps twenty times faster: requests no longer pile up between arrivals.
    _, sim_steps = run_sim(args, work, [r.duration / 20 for r in records] * 10)
    assert [r.batch for r in records] != [batch for _, _, batch in sim_steps]
