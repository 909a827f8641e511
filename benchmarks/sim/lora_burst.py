"""Fair share across LoRA adapters under a burst, in the simulator (Llama-3-8B shape, H100
roofline, virtual time: the figures are the same on any CPU).

    PYTHONPATH=src python -m benchmarks.sim.lora_burst
    PYTHONPATH=src python -m benchmarks.sim.lora_burst --max-loras 2 --swap-ms 3 --burst 600

Workload: adapter ``burst`` sends ``--burst`` requests at ``--burst-rate`` per second from
t=0; adapters ``t1``..``t3`` and the base model trickle ``--trickle-rate`` requests per
second each for as long (prompts 256 tokens, 128 output tokens). ``--max-loras`` slots
(default 1, vLLM's default), each adapter swap into a slot costs ``--swap-ms`` of step time.

Four engines: fcfs and fair (the fair policy counts each adapter as a tenant), each with
the LoRA gate's drain rule off and on (core/lora_gate.py). Per adapter: TTFT p50 / p90 /
max, its share of the tokens generated while the burst was backlogged (until its last
request was admitted) and its demand (its requests' share of the output tokens asked for
by then). The goal: the trickling adapters' TTFT stays within a few of their
requests' length of the base model's under the burst, instead of waiting for the burst.
"""

from __future__ import annotations

import argparse
import dataclasses
import random

from conveyor.bench.workload import BenchRequest
from conveyor.config import EngineArgs
from conveyor.costs.factory import make_cost_model
from conveyor.sim.model import resolve_sim_model
from conveyor.sim.simulator import Simulator

PROMPT, OUTPUT = 256, 128
TRICKLERS = ("t1", "t2", "t3", None)  # None: the base model


def workload(burst: int, burst_rate: float, trickle_rate: float, vocab: int,
             seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    span = burst / burst_rate
    reqs = []

    def add(t: float, lora: str | None) -> None:
        prompt = [rng.randrange(16, vocab) for _ in range(PROMPT)]
        reqs.append(BenchRequest(f"{lora or 'base'}-{len(reqs)}", t, prompt, OUTPUT,
                                 lora=lora))

    for i in range(burst):
        add(i / burst_rate, "burst")
    for k, lora in enumerate(TRICKLERS):
        t = (k + 1) / (len(TRICKLERS) + 1) / trickle_rate  # staggered starts
        while t < span:
            add(t, lora)
            t += 1.0 / trickle_rate
    return reqs


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def run(policy: str, drain: bool, reqs: list[BenchRequest], max_loras: int, swap_s: float
        ) -> dict[str, dict[str, float]]:
    args = EngineArgs(model="llama3-8b", load_format="dummy", enable_lora=True,
                      max_loras=max_loras, scheduling_policy=policy)
    model = resolve_sim_model(args)
    sim = Simulator(args, make_cost_model("roofline", model, hardware="h100"), model=model,
                    lora_swap_s=swap_s)
    sim.config = dataclasses.replace(sim.config, scheduler=dataclasses.replace(
        sim.config.scheduler, lora_drain=drain))
    result = sim.run(reqs)
    assert not result.unfinished and not result.errors, (result.unfinished, result.errors)
    lora_of = {r.request_id: r.lora or "base" for r in reqs}
    metrics = result.finished
    # The burst's backlog lasts until its last request is admitted.
    backlog_end = max(m.first_scheduled_time for rid, m in metrics.items()
                      if lora_of[rid] == "burst")
    tokens: dict[str, int] = {}
    demand: dict[str, int] = {}  # output tokens of the requests that arrived by then
    ttft: dict[str, list[float]] = {}
    for rid, m in metrics.items():
        name = lora_of[rid]
        ttft.setdefault(name, []).append(m.first_token_time - m.arrival_time)
        tokens[name] = tokens.get(name, 0) + sum(t <= backlog_end for t in m.token_times)
        if m.arrival_time <= backlog_end:
            demand[name] = demand.get(name, 0) + m.num_generation_tokens
    total, asked = sum(tokens.values()) or 1, sum(demand.values()) or 1
    return {name: {"n": len(v), "p50": pct(v, .5), "p90": pct(v, .9), "max": max(v),
                   "share": tokens.get(name, 0) / total,
                   "demand": demand.get(name, 0) / asked, "backlog_s": backlog_end}
            for name, v in sorted(ttft.items())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-loras", type=int, default=1)
    p.add_argument("--swap-ms", type=float, default=3.0)
    p.add_argument("--burst", type=int, default=600)
    p.add_argument("--burst-rate", type=float, default=100.0)
    p.add_argument("--trickle-rate", type=float, default=1.0)
    a = p.parse_args()
    model = resolve_sim_model(EngineArgs(model="llama3-8b", load_format="dummy"))
    reqs = workload(a.burst, a.burst_rate, a.trickle_rate, model.vocab_size)
    print(f"{len(reqs)} requests: burst {a.burst} at {a.burst_rate}/s, t1-t3 and base at "
          f"{a.trickle_rate}/s each; --max-loras {a.max_loras}, swap {a.swap_ms} ms")
    for policy in ("fcfs", "fair"):
        for drain in (False, True):
            res = run(policy, drain, reqs, a.max_loras, a.swap_ms / 1e3)
            backlog = next(iter(res.values()))["backlog_s"]
            print(f"\n{policy}, drain rule {'on' if drain else 'off'} (burst backlogged "
                  f"{backlog:.1f} s)")
            print(f"  {'adapter':8} {'reqs':>5} {'TTFT p50':>9} {'p90':>8} {'max':>8} "
                  f"{'token share':>12} {'demand':>7}")
            for name, r in res.items():
                print(f"  {name:8} {r['n']:5d} {r['p50']:8.2f}s {r['p90']:7.2f}s "
                      f"{r['max']:7.2f}s {r['share']:11.1%} {r['demand']:7.1%}")


if __name__ == "__main__":
    main()
