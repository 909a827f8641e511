"""How fast the simulator runs: a synthetic workload the size of the Azure conversation trace.

    PYTHONPATH=src python -m benchmarks.sim.sim_scale   # 19,366 requests, llama3-8b, h100

Prompt and output lengths are lognormal with the trace's means and medians (prompts:
mean 1,155, median 1,020 tokens; outputs: mean 211, median 129, at most 1,000),
arrivals Poisson over one hour. Prints the exact parameters, the simulator's wall
time, its CPU time (steadier than wall time on a shared machine) and its events
(arrivals plus engine steps) per second. The target is under a minute of wall time.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time

from conveyor.bench.workload import BenchRequest
from conveyor.config import EngineArgs
from conveyor.costs.factory import make_cost_model
from conveyor.sim import Simulator, resolve_sim_model


def lognormal_params(mean: float, median: float) -> tuple[float, float]:
    return math.log(median), math.sqrt(2 * math.log(mean / median))


def synthetic_workload(n: int, duration_s: float, prompt_mean: float, prompt_median: float,
                       output_mean: float, output_median: float, output_max: int,
                       vocab: int, max_prompt: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    # Prompts are slices of one random token stream at random offsets: distinct prompts
    # (no accidental prefix sharing) whose ints are shared objects, so 19k prompts of
    # ~1k tokens cost ~200 MB rather than ~800 MB.
    stream = [rng.randrange(10, vocab) for _ in range(1 << 18)]
    p_mu, p_sigma = lognormal_params(prompt_mean, prompt_median)
    o_mu, o_sigma = lognormal_params(output_mean, output_median)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(n / duration_s)
        p = min(max_prompt, max(1, round(rng.lognormvariate(p_mu, p_sigma))))
        o = min(output_max, max(1, round(rng.lognormvariate(o_mu, o_sigma))))
        start = rng.randrange(0, len(stream) - p)
        out.append(BenchRequest(f"r{i}", t, stream[start:start + p], o))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    EngineArgs.add_cli_args(p)
    p.set_defaults(model="llama3-8b", max_num_seqs=256, max_num_batched_tokens=8192)
    p.add_argument("--num-requests", type=int, default=19366)
    p.add_argument("--duration-s", type=float, default=3600.0)
    p.add_argument("--prompt-mean", type=float, default=1155)
    p.add_argument("--prompt-median", type=float, default=1020)
    p.add_argument("--output-mean", type=float, default=211)
    p.add_argument("--output-median", type=float, default=129)
    p.add_argument("--output-max", type=int, default=1000)
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--hardware", default="h100")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--router", default="round_robin")
    args = p.parse_args(argv)
    engine_args = EngineArgs.from_cli_args(args)
    model = resolve_sim_model(engine_args)
    cost = make_cost_model("roofline", model, hardware=args.hardware, tp=args.tp)
    sim = Simulator(engine_args, cost, replicas=args.replicas, router=args.router, model=model)

    t0 = time.perf_counter()
    work = synthetic_workload(args.num_requests, args.duration_s, args.prompt_mean,
                              args.prompt_median, args.output_mean, args.output_median,
                              args.output_max, model.vocab_size, sim.max_model_len - 1,
                              args.workload_seed)
    gen_s = time.perf_counter() - t0
    print(f"parameters: model={args.model} hardware={args.hardware} tp={args.tp} "
          f"replicas={args.replicas} router={args.router} "
          f"policy={engine_args.scheduling_policy} max_num_seqs={engine_args.max_num_seqs} "
          f"max_num_batched_tokens={engine_args.max_num_batched_tokens} "
          f"block_size={engine_args.block_size} "
          f"prefix_caching={engine_args.enable_prefix_caching} kv_blocks={sim.num_kv_blocks}")
    print(f"workload: {len(work)} requests over {args.duration_s:g}s, prompt mean "
          f"{statistics.fmean(len(r.prompt_token_ids) for r in work):.0f} tokens, output mean "
          f"{statistics.fmean(r.output_len for r in work):.0f} (seed {args.workload_seed}; "
          f"generated in {gen_s:.1f}s)")
    print(f"cost model: {cost.describe()}")

    cpu0 = time.process_time()
    result = sim.run(work)
    cpu_s = time.process_time() - cpu0
    ms = result.metrics
    ttft = statistics.median(m.ttft for m in ms)
    tpots = [m.tpot for m in ms if m.tpot is not None]
    tokens = sum(m.num_generation_tokens for m in ms)
    print(f"simulated {len(ms)} finished ({len(result.errors)} refused, "
          f"{len(result.unfinished)} unfinished) in {result.sim_time:.0f}s of virtual time: "
          f"{result.num_steps} steps, {tokens} tokens generated, TTFT p50 {ttft * 1e3:.1f} ms, "
          f"TPOT p50 {statistics.median(tpots) * 1e3:.2f} ms, "
          f"preemptions {sum(r.num_preemptions for r in result.replicas)}")
    print(f"simulator: wall {result.wall_s:.1f}s, cpu {cpu_s:.1f}s; "
          f"{result.num_events} events ({len(work)} arrivals + {result.num_steps} steps): "
          f"{result.events_per_s:,.0f} events/s, "
          f"{tokens / result.wall_s:,.0f} simulated tokens/s; "
          f"{'under' if result.wall_s < 60 else 'OVER'} the one-minute target "
          f"(on a shared machine the cpu time is the steadier figure)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
