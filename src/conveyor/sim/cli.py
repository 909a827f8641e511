"""``conveyor sim``: replay a workload through simulated engines, reported as ``conveyor bench``.

    conveyor sim --model llama3-8b --workload azure_conv_2023.csv --hardware h100 \\
        --max-num-seqs 256 --max-num-batched-tokens 8192 --replicas 4 --out sim.json
    conveyor sim --model tiny --dtype float32 --cost profile.json --workload conversation ...
    conveyor bench compare real.json sim.json           # a real run against a simulated one
    conveyor sim ... --find-capacity --slo-ttft 500 --slo-tpot 50 --attainment 0.9
    conveyor sim ... --find-capacity rate --replicas 2 --slo-ttft 500

Never imports torch: the model is read from config.json (or a built-in shape), and a
cost model (``roofline`` or a ``conveyor profile`` fit) stands in for the runner.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

from conveyor.bench.workload import BenchRequest, WorkloadError, add_workload_args, describe
from conveyor.config import EngineArgs
from conveyor.sim.router import ROUTERS


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim", help="simulate serving a workload (any hardware, any scale) "
                                   "and report as `conveyor bench` does",
                       description=__doc__.splitlines()[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="\n".join(__doc__.splitlines()[2:]))
    add_sim_args(p)
    p.set_defaults(func=run)


def add_sim_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    EngineArgs.add_cli_args(p)
    add_workload_args(p)
    g = p.add_argument_group("simulation")
    g.add_argument("--cost", default="roofline",
                   help="roofline (from --hardware) or the profile.json of `conveyor profile` "
                        "(default: roofline)")
    g.add_argument("--hardware", default="h100",
                   help="roofline: a100, h100, h200, cpu, or a JSON file of the same fields "
                        "(default: h100)")
    g.add_argument("--tp", type=int, default=1, help="roofline: tensor-parallel degree")
    g.add_argument("--replicas", type=int, default=1, help="engine replicas behind the router")
    g.add_argument("--router", default="least_loaded", choices=sorted(ROUTERS),
                   help="which replica takes a new request (default: least_loaded)")
    g.add_argument("--lora-mix", default=None, metavar="NAME=SHARE,...",
                   help="with --enable-lora: each request draws the adapter it names from "
                        "this mix (the name 'base': none), e.g. sql=0.6,chat=0.2,base=0.2")
    g.add_argument("--lora-swap-ms", type=float, default=0.0,
                   help="with --enable-lora: a step's cost per adapter it swaps into one of "
                        "the --max-loras slots (default 0)")
    g.add_argument("--out", default=None, help="save the summary as JSON here (readable by "
                                               "`conveyor bench compare`)")
    g.add_argument("--records", default=None,
                   help="save per-request records as JSONL here (default with --out: next to "
                        "it, .records.jsonl)")
    g.add_argument("--plot", default=None, metavar="DIR",
                   help="write latency CDFs here (PNG; needs matplotlib: pip install "
                        "conveyor[plots])")
    c = p.add_argument_group("capacity search (with --slo-ttft and/or --slo-tpot, in ms)")
    c.add_argument("--find-capacity", nargs="?", const="replicas", default=None,
                   choices=("replicas", "rate"),
                   help="replicas: the fewest replicas that meet the SLOs; rate: the highest "
                        "request rate per replica (with --replicas of them) that does")
    c.add_argument("--attainment", type=float, default=0.9,
                   help="share of requests that must meet the SLOs (default 0.9)")
    c.add_argument("--max-replicas", type=int, default=64,
                   help="--find-capacity replicas: give up beyond this many (default 64)")
    c.add_argument("--rate-tolerance", type=float, default=0.02,
                   help="--find-capacity rate: stop when the bracket is this tight, relative "
                        "(default 0.02)")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (WorkloadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def sim_inputs(args: argparse.Namespace):
    """(engine args, model, cost model, requests) of ``conveyor sim`` options: what the
    command runs, and what benchmark scripts that drive the simulator start from."""
    from conveyor.bench.workload import load_workload
    from conveyor.costs.factory import make_cost_model
    from conveyor.sim.model import resolve_sim_model

    engine_args = EngineArgs.from_cli_args(args)
    model = resolve_sim_model(engine_args)
    cost = make_cost_model(args.cost, model, hardware=args.hardware, tp=args.tp)
    requests = load_workload(args, model.vocab_size)
    if getattr(args, "lora_mix", None):
        assign_adapters(requests, args.lora_mix, args.seed, engine_args.enable_lora)
    return engine_args, model, cost, requests


def assign_adapters(requests: list, mix_text: str, seed: int, enable_lora: bool) -> None:
    """Each request names an adapter drawn (seeded) from ``--lora-mix``."""
    import random

    from conveyor.bench.workload import _parse_mix

    if not enable_lora:
        raise ValueError("--lora-mix needs --enable-lora")
    mix = _parse_mix(mix_text)
    rng = random.Random(seed + 3)
    names, weights = list(mix), list(mix.values())
    for req in requests:
        name = rng.choices(names, weights)[0]
        req.lora = None if name == "base" else name


def _run(args: argparse.Namespace) -> int:
    from conveyor.sim.simulator import Simulator

    _check_args(args)
    engine_args, model, cost, requests = sim_inputs(args)
    print(f"workload: {args.workload}: {describe(requests)}")
    sim = Simulator(engine_args, cost, replicas=args.replicas, router=args.router, model=model,
                    lora_swap_s=args.lora_swap_ms / 1e3)
    print(f"target: {_target_line(args, sim)}")
    print(f"cost model: {cost.describe()}")
    extra: dict[str, Any] = {}
    result = None
    if args.find_capacity:
        found = _find_capacity(args, engine_args, cost, requests)
        if found is None:
            return 1
        sim, requests, extra["capacity"], result = found
    if result is None:
        cpu0 = time.process_time()
        result = sim.run(requests)
        # CPU time is the steadier figure on a shared machine (wall time counts waiting).
        cpu = f" ({time.process_time() - cpu0:.2f}s cpu)"
    else:
        cpu = " (the search's run at the answer)"
    print(f"simulator: {result.num_events - result.num_steps} arrivals + {result.num_steps} "
          f"steps = {result.num_events} events in {result.wall_s:.2f}s wall{cpu}: "
          f"{result.events_per_s:,.0f} events/s; {result.sim_time:,.1f}s simulated")
    return _report(args, requests, result, sim, extra)


def _report(args: argparse.Namespace, requests: list[BenchRequest], result, sim,
            extra: dict[str, Any]) -> int:
    from conveyor.bench import report
    from conveyor.sim.results import run_result

    run = run_result(requests, result, sim)
    done = [r for r in run.records if not r.error]
    prompt = sum(r.prompt_tokens for r in done)
    # The share of completed requests' prompt tokens served from the prefix cache: what a
    # router's placement changes.
    extra["prefix_cache_hit_rate"] = (sum(r.num_cached_tokens for r in done) / prompt
                                      if prompt else 0.0)
    print()
    print(report.format_summary(run.summary, f"sim run ({sim.num_replicas} replica"
                                             f"{'s' if sim.num_replicas > 1 else ''})"))
    if sim.num_replicas > 1:
        busy = [f"{r.busy_time / result.sim_time:.0%}" if result.sim_time else "-"
                for r in result.replicas]
        print(f"replica requests: {[r.num_requests for r in result.replicas]}; busy: {busy}")
    print(f"prefix cache hit rate: {extra['prefix_cache_hit_rate']:.1%} of prompt tokens")
    failed = [r for r in run.records if r.error]
    if failed:
        print(f"\n{len(failed)} requests failed; first: request {failed[0].request_id}: "
              f"{failed[0].error}")
    if args.out:
        report.save_json(args.out, [run], _config_dict(args), extra)
        print(f"\nsummary saved to {args.out}")
    records_path = args.records
    if records_path is None and args.out:
        records_path = os.path.splitext(args.out)[0] + ".records.jsonl"
    if records_path:
        report.save_records(records_path, [run])
        print(f"per-request records saved to {records_path}")
    if args.plot:
        from conveyor.bench.plots import plot_latency_cdfs

        print("figures: " + plot_latency_cdfs([run], os.path.join(args.plot,
                                                                  "latency_cdf.png")))
    return 0 if run.summary.num_completed else 1


# ---- capacity -----------------------------------------------------------------------------
def _find_capacity(args: argparse.Namespace, engine_args: EngineArgs, cost,
                   requests: list[BenchRequest]):
    """Search, print the trace and the answer; returns (simulator, requests, summary, the
    search's run) at the answer, or None if no probe met the SLOs."""
    from conveyor.sim.capacity import SLO, at_rate, find_max_rate, find_min_replicas
    from conveyor.sim.simulator import Simulator

    slo = SLO(ttft_s=None if args.slo_ttft is None else args.slo_ttft / 1e3,
              tpot_s=None if args.slo_tpot is None else args.slo_tpot / 1e3,
              attainment=args.attainment)
    bounds = " and ".join(f"{name} <= {value:g} ms" for name, value in
                          (("TTFT", args.slo_ttft), ("TPOT", args.slo_tpot))
                          if value is not None)
    by_replicas = args.find_capacity == "replicas"
    goal = ("the fewest replicas" if by_replicas else
            f"the highest request rate per replica ({args.replicas} replicas)")
    print(f"\nfind-capacity: {goal} at which at least {args.attainment:.0%} of the "
          f"{len(requests)} requests meet {bounds} (router {args.router})")
    unit = "" if by_replicas else " req/s per replica"

    def show(value: float) -> str:
        return f"{value:g} replica{'s' if value != 1 else ''}" if by_replicas \
            else f"{value:.4g}{unit}"

    def log(probe) -> None:
        att = (f"attainment < {args.attainment:.0%} (stopped once out of reach)"
               if probe.stopped_early else f"attainment {probe.attainment:.1%}")
        print(f"  probe {show(probe.value):>28}: {att:<44} "
              f"{'meets' if probe.meets else 'misses'}  [{probe.wall_s:.2f}s]", flush=True)

    if by_replicas:
        found = find_min_replicas(requests, engine_args, cost, slo, router=args.router,
                                  max_replicas=args.max_replicas, log=log)
    else:
        found = find_max_rate(requests, engine_args, cost, slo, replicas=args.replicas,
                              router=args.router, rel_tol=args.rate_tolerance, log=log)
    wall = sum(p.wall_s for p in found.probes)
    if found.value is None:
        limit = (f"up to {args.max_replicas} replicas" if by_replicas
                 else f"down to {found.failing:.4g}{unit}")
        print(f"answer: none: no probe ({limit}) meets the SLOs "
              f"({len(found.probes)} probes, {wall:.1f}s)")
        return None
    nearest = "" if found.failing is None else f"; {show(found.failing)} misses"
    if found.failing is None and not by_replicas:
        nearest = "; every probe met the SLOs, so this is a lower bound"
    print(f"answer: {show(found.value)}{nearest} ({len(found.probes)} probes, "
          f"{wall:.1f}s)")
    summary = {"search": args.find_capacity, "value": found.value, "failing": found.failing,
               "slo_ttft_ms": args.slo_ttft, "slo_tpot_ms": args.slo_tpot,
               "attainment": args.attainment,
               "probes": [{"value": p.value, "attainment": p.attainment, "meets": p.meets,
                           "stopped_early": p.stopped_early, "wall_s": p.wall_s}
                          for p in found.probes]}
    if by_replicas:
        sim = Simulator(engine_args, cost, replicas=int(found.value), router=args.router)
        print(f"\nthe workload on {show(found.value)}:")
        return sim, requests, summary, found.result
    times = {r.request_id: r.arrival_s
             for r in at_rate(requests, found.value * args.replicas)}
    requests = [dataclasses.replace(r, arrival_s=times[r.request_id]) for r in requests]
    print(f"\nthe workload at {show(found.value)}: {describe(requests)}")
    sim = Simulator(engine_args, cost, replicas=args.replicas, router=args.router)
    return sim, requests, summary, found.result


# ---- helpers ------------------------------------------------------------------------------
def _check_args(args: argparse.Namespace) -> None:
    if args.replicas < 1:
        raise WorkloadError(f"--replicas must be >= 1, got {args.replicas}")
    if getattr(args, "async_scheduling", False):  # accepted by EngineArgs, not simulated
        raise WorkloadError("--async-scheduling is not simulated (the simulator runs each "
                            "step's schedule and update at virtual times of its own)")
    if args.request_rate is not None and args.time_scale != 1.0:
        raise WorkloadError("--request-rate and --time-scale both set arrival times: pass one")
    if args.find_capacity:
        if args.slo_ttft is None and args.slo_tpot is None:
            raise WorkloadError("--find-capacity needs --slo-ttft and/or --slo-tpot (ms)")
        if not 0 < args.attainment <= 1:
            raise WorkloadError(f"--attainment must be in (0, 1], got {args.attainment}")
        if args.max_replicas < 1:
            raise WorkloadError(f"--max-replicas must be >= 1, got {args.max_replicas}")
        if not args.rate_tolerance > 0:
            raise WorkloadError(f"--rate-tolerance must be > 0, got {args.rate_tolerance}")


def _target_line(args: argparse.Namespace, sim) -> str:
    e = sim.engine_args
    count = ("simulated replicas (how many: searched)" if args.find_capacity == "replicas"
             else f"{sim.num_replicas} simulated replica{'s' if sim.num_replicas > 1 else ''}")
    return (f"{count} (router {args.router}) of model {args.model} ({sim.config.model.dtype}), "
            f"batching {e.batching}, max_num_seqs {e.max_num_seqs}, max_num_batched_tokens "
            f"{e.max_num_batched_tokens}, policy {e.scheduling_policy}, prefix caching "
            f"{'on' if e.enable_prefix_caching else 'off'}, {sim.num_kv_blocks} KV blocks of "
            f"{e.block_size} per replica (max model len {sim.max_model_len})")


def _config_dict(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for key, value in vars(args).items():
        if key == "func" or callable(value):
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            value = str(value)
        out[key] = value
    return out


def parse_sim_args(argv: list[str]) -> argparse.Namespace:
    """The options of ``conveyor sim ARGV`` (for scripts that drive the simulator)."""
    return add_sim_args(argparse.ArgumentParser(prog="conveyor sim")).parse_args(argv)
