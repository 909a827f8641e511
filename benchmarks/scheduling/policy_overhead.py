"""Scheduler CPU time per step under each policy as the waiting queue grows.

No model and no torch: a stand-in runner answers every step, so what is timed is
``schedule()`` + ``update()`` alone, i.e. what a simulator pays per virtual step.
Queues of tens of thousands of waiting requests must not make a step linear in the
queue length. Prints one table: mean microseconds per step, and the ratio to the
smallest queue of the same policy (a flat ratio means no per-step O(n) work).
Wall-clock figures are noisy on a shared machine; the Python call count per step
(``--count-calls``) is the deterministic version of the same check.

    python -m benchmarks.scheduling.policy_overhead   # 1k, 10k, 50k waiting
    python -m benchmarks.scheduling.policy_overhead --sizes 1000 100000 --steps 300
"""

from __future__ import annotations

import argparse
import random
import time

from conveyor.config import PolicyConfig, SchedulerConfig
from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.core.policies import POLICIES
from conveyor.core.scheduler import Scheduler
from conveyor.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams


def fake_run(out: SchedulerOutput) -> ModelRunnerOutput:
    return ModelRunnerOutput({rid: [7] for rid in out.sampling_req_ids})


def build(policy: str, num_waiting: int, args: argparse.Namespace) -> Scheduler:
    rng = random.Random(args.seed)
    cfg = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        scheduling_policy=policy, max_queue_wait_s=args.max_queue_wait_s,
        policy=PolicyConfig(sjf_aging_s=30.0, default_slo_ttft_s=5.0, lpm_window=64))
    kv = KVCacheManager(args.num_blocks, args.block_size, enable_prefix_caching=True)
    sched = Scheduler(cfg, kv, max_model_len=4096)
    prefixes = [[rng.randrange(5, 30000) for _ in range(256)] for _ in range(32)]
    for i in range(num_waiting):
        prompt = prefixes[rng.randrange(32)][:rng.randrange(0, 256)]
        prompt += [rng.randrange(5, 30000) for _ in range(rng.randint(16, 256))]
        max_tokens = rng.randint(16, 256)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                expected_output_tokens=rng.randint(1, max_tokens))
        arrival = i * 1e-3  # all arrived before the timed steps start
        sched.add_request(Request(f"r{i}", prompt, params, arrival, max_tokens=max_tokens,
                                  priority=rng.randrange(4), tenant=f"t{rng.randrange(100)}",
                                  slo_ttft_s=rng.choice([None, 1.0, 10.0])), arrival)
    return sched


def time_steps(sched: Scheduler, steps: int, start: float, warmup: int = 20) -> float:
    """Mean seconds of one schedule() + update(), after ``warmup`` untimed steps."""
    now = start
    for _ in range(warmup):
        out = sched.schedule(now)
        sched.update(out, fake_run(out), now)
        now += 0.05
    t0 = time.perf_counter()
    for _ in range(steps):
        out = sched.schedule(now)
        sched.update(out, fake_run(out), now)
        now += 0.05
    return (time.perf_counter() - t0) / steps


def count_calls(sched: Scheduler, steps: int, start: float, warmup: int = 20) -> float:
    """Mean Python function calls of one schedule() + update(): a noise-free cost proxy."""
    import cProfile
    import pstats

    time_steps(sched, 1, start, warmup)
    prof = cProfile.Profile()
    prof.enable()
    time_steps(sched, steps, start + warmup * 0.05 + 0.05, 0)
    prof.disable()
    return sum(v[1] for v in pstats.Stats(prof).stats.values()) / steps


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", nargs="+", default=sorted(POLICIES))
    p.add_argument("--sizes", nargs="+", type=int, default=[1000, 10_000, 50_000])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-queue-wait-s", type=float, default=3600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count-calls", action="store_true",
                   help="report Python function calls per step instead of time")
    args = p.parse_args()
    print(f"policy_overhead: {vars(args)}")
    print(f"{'policy':>9} " + " ".join(f"{n:>12,}" for n in args.sizes) + "   ratio last/first")
    for name in args.policies:
        per_step = []
        for n in args.sizes:
            sched = build(name, n, args)
            if args.count_calls:
                per_step.append(count_calls(sched, args.steps, n * 1e-3, args.warmup))
            else:
                per_step.append(time_steps(sched, args.steps, n * 1e-3, args.warmup))
        unit = "calls" if args.count_calls else "us"
        scale = 1 if args.count_calls else 1e6
        cells = " ".join(f"{t * scale:>9.0f} {unit:<5}" for t in per_step)
        print(f"{name:>9} {cells}   {per_step[-1] / per_step[0]:.2f}x")
