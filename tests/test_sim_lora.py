"""The simulator with adapters (issue 49): requests name adapters, the real scheduler's
``--max-loras`` gate and load orders run on the cost-model executor, adapter swaps into the
``max_loras`` slots are priced, and the drain rule keeps a burst from starving the others."""

from __future__ import annotations

import dataclasses

from sim_helpers import LinearCost, tiny_args

from conveyor.bench.workload import BenchRequest
from conveyor.sim.simulator import Simulator


def burst_workload() -> list[BenchRequest]:
    reqs = [BenchRequest(f"burst-{i}", i * 0.01, [5 + i % 7] * 12, 16, lora="burst")
            for i in range(120)]
    reqs += [BenchRequest(f"late-{i}", 0.05 + i * 0.2, [9] * 12, 4, lora=f"late{i % 2}")
             for i in range(4)]
    reqs.append(BenchRequest("base", 0.07, [11] * 12, 4))
    return reqs


def simulate(drain: bool, swap_s: float = 0.0, max_loras: int = 1):
    sim = Simulator(tiny_args(enable_lora=True, max_loras=max_loras, max_num_seqs=16),
                    LinearCost(), lora_swap_s=swap_s)
    sim.config = dataclasses.replace(sim.config, scheduler=dataclasses.replace(
        sim.config.scheduler, lora_drain=drain))
    steps = []
    sim.step_listeners.append(lambda r, start, end, out: steps.append((start, end, out)))
    return sim.run(burst_workload()), steps


def adapters_in(out, lora_of) -> set[str]:
    return {lora_of[rid] for rid in out.num_scheduled_tokens} - {None}


def test_adapters_in_the_simulator_respect_max_loras_and_finish():
    lora_of = {r.request_id: r.lora for r in burst_workload()}
    result, steps = simulate(drain=True)
    assert not result.unfinished and not result.errors
    assert len(result.finished) == 125
    assert all(len(adapters_in(out, lora_of)) <= 1 for _, _, out in steps)
    assert result.finished["base"].first_token_time - 0.07 < 0.1  # the base model passes


def test_the_drain_rule_keeps_a_burst_from_starving_other_adapters():
    on, _ = simulate(drain=True)
    off, _ = simulate(drain=False)

    def late_ttft(result):
        return max(m.first_token_time - m.arrival_time for rid, m in result.finished.items()
                   if rid.startswith("late"))

    last_burst_admitted = max(m.first_scheduled_time for rid, m in off.finished.items()
                              if rid.startswith("burst"))
    # without it the late adapters wait for the burst's backlog; with it, for a drain
    assert late_ttft(off) > last_burst_admitted - 0.65
    assert late_ttft(on) < late_ttft(off) / 3, (late_ttft(on), late_ttft(off))


def test_adapter_swaps_cost_step_time():
    """Two slots: a step pays per adapter not in a slot, the least recently used goes."""
    from conveyor.config.lora import LoRARequest
    from conveyor.core.scheduler_output import NewRequestData, SchedulerOutput
    from conveyor.executor.lora_slots import AdapterSlots

    slots = AdapterSlots(2, swap_s=0.5)

    def step(*loras: int, finished=()) -> float:
        new = [NewRequestData(f"r{len(slots.adapter_of) + i}", [1], [], None, [], 0,
                              LoRARequest(f"a{k}", k, "x") if k else None)
               for i, k in enumerate(loras)]
        return slots.step_cost(SchedulerOutput(new_reqs=new, finished_req_ids=set(finished),
                                               num_scheduled_tokens={n.req_id: 1
                                                                     for n in new}))

    assert step(1, 2, 0) == 1.0  # two swaps in, the base model's row is free
    assert step(1, 2) == 0.0
    assert step(3) == 0.5  # a1 (least recently used) goes
    assert step(2, 3) == 0.0 and step(1) == 0.5
    free, _ = simulate(drain=True)
    priced, _ = simulate(drain=True, swap_s=0.05)
    assert priced.sim_time > free.sim_time + 0.05 * 4


def test_prefix_router_scores_an_adapter_by_its_own_blocks():
    """``--router prefix`` in the simulator: blocks a replica cached for adapter x count
    for x's next request with that prompt (it goes there though the other replica is as
    idle), and the base model's request with the same prompt finds no hit there."""
    prompt = [(3 * i) % 200 + 4 for i in range(64)]
    other = [(5 * i) % 200 + 4 for i in range(64)]
    reqs = [BenchRequest("base-first", 0.0, other, 4),
            BenchRequest("x-first", 0.001, prompt, 4, lora="x"),
            BenchRequest("base-same-prompt", 5.0, prompt, 4),
            BenchRequest("x-again", 6.0, prompt, 4, lora="x")]
    sim = Simulator(tiny_args(enable_lora=True, max_loras=2, enable_prefix_caching=True),
                    LinearCost(), replicas=2, router="prefix")
    result = sim.run(reqs)
    assert result.replica_of["x-first"] != result.replica_of["base-first"]
    # x's blocks are no hit for the base model: it goes by load (the lower index)
    assert result.replica_of["base-same-prompt"] == result.replica_of["base-first"]
    assert result.replica_of["x-again"] == result.replica_of["x-first"]
    assert result.finished["x-again"].num_cached_tokens == 48
    assert result.finished["base-same-prompt"].num_cached_tokens == 0


def test_conveyor_sim_lora_mix(capsys):
    """``conveyor sim --enable-lora --lora-mix``: requests draw adapters from the mix and
    run; without --enable-lora the option is a clear error."""
    from conveyor.entrypoints.cli import main
    from conveyor.sim.cli import parse_sim_args, sim_inputs

    argv = ["--model", "llama3-8b", "--workload", "conversation", "--num-requests", "30",
            "--input-scale", "0.25", "--output-scale", "0.25", "--enable-lora",
            "--max-loras", "2", "--lora-mix", "a=0.5,b=0.3,base=0.2", "--lora-swap-ms", "2"]
    _, _, _, requests = sim_inputs(parse_sim_args(argv))
    names = {r.lora for r in requests}
    assert names == {"a", "b", None}
    assert main(["sim", *argv]) == 0
    capsys.readouterr()
    assert main(["sim", *[a for a in argv if a != "--enable-lora"]]) != 0
    assert "--lora-mix needs --enable-lora" in capsys.readouterr().err
