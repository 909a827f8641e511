"""Capacity per replica at SLO attainment: the SLO token budget against fixed budgets.

The simulator question of issue 21, side by side in one run: for each workload, the
highest request rate one replica serves with at least 90% of requests within TTFT
<= 500 ms and TPOT <= 50 ms (``conveyor sim --find-capacity rate``: the real scheduler on
a virtual clock, Llama-3-8B shape, H100 roofline, 256 sequences), under ``fcfs`` at each
fixed ``--max-num-batched-tokens`` and under ``slo`` (the budget chosen each step by the
cost model, the same budget as its ceiling). Then: slo against the best fixed budget.

    python -m benchmarks.sim.slo_budget  # every workload, ~15 min
    python -m benchmarks.sim.slo_budget --workloads azure --num-requests 500  # a quick look

Workloads (``--traces`` holds the shared traces; a missing trace is skipped, said so):
``azure`` the Azure 2023 conversation trace; ``azure-x4`` the same with prompts x4;
``mooncake`` the Mooncake synthetic trace (prompts scaled by ``--mooncake-input-scale``,
see below); ``bursty`` the conversation preset with gamma arrivals (shape 0.25).
Every probe is a whole simulated run; each search prints as it goes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

from benchmarks.common import SHARED_TRACES
from conveyor.bench.workload import describe, load_workload
from conveyor.config import EngineArgs
from conveyor.costs.factory import make_cost_model
from conveyor.sim import SLO, find_max_rate, resolve_sim_model
from conveyor.sim.cli import parse_sim_args


@dataclass(frozen=True)
class Config:
    label: str
    args: tuple[str, ...]  # engine flags beyond the common ones


def workloads(opts) -> dict[str, list[str] | str]:
    """name -> workload flags, or the reason it is skipped."""
    azure = os.path.join(opts.traces, "azure_conv_2023.csv")
    mooncake = os.path.join(opts.traces, "mooncake_synthetic.jsonl")
    n = str(opts.num_requests)
    out: dict[str, list[str] | str] = {}
    for name, path, flags in (
            ("azure", azure, []), ("azure-x4", azure, ["--input-scale", "4"]),
            ("mooncake", mooncake, ["--input-scale", str(opts.mooncake_input_scale)])):
        out[name] = ["--workload", path, "--num-requests", n, *flags] \
            if os.path.isfile(path) else f"skipped: {path} not found"
    out["bursty"] = ["--workload", "conversation", "--num-requests", n, "--request-rate",
                     "20", "--burstiness", "0.25", "--seed", "1"]
    return {k: v for k, v in out.items() if k in opts.workloads}


def configs(opts) -> list[Config]:
    out = [Config(f"fcfs {b}", ("--scheduling-policy", "fcfs", "--max-num-batched-tokens",
                                str(b))) for b in opts.budgets]
    out.append(Config(f"slo {opts.ceiling}", ("--scheduling-policy", "slo",
                                              "--max-num-batched-tokens", str(opts.ceiling))))
    for extra in opts.extra:
        label, _, flags = extra.partition("=")
        out.append(Config(label, tuple(flags.split())))
    return out


def search(workload_flags: list[str], config: Config, opts) -> tuple[float | None, float]:
    argv = ["--model", "llama3-8b", "--hardware", opts.hardware, "--max-num-seqs", "256",
            "--slo-ttft", str(opts.slo_ttft), "--slo-tpot", str(opts.slo_tpot),
            *workload_flags, *config.args]
    args = parse_sim_args(argv)
    engine_args = EngineArgs.from_cli_args(args)
    model = resolve_sim_model(engine_args)
    cost = make_cost_model("roofline", model, hardware=opts.hardware)
    requests = load_workload(args, model.vocab_size)
    slo = SLO(ttft_s=opts.slo_ttft / 1e3, tpot_s=opts.slo_tpot / 1e3,
              attainment=opts.attainment)
    t0 = time.process_time()
    found = find_max_rate(requests, engine_args, cost, slo, replicas=1, router="least_loaded",
                          rel_tol=opts.rate_tolerance)
    return found.value, time.process_time() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="azure,azure-x4,mooncake,bursty",
                   type=lambda s: s.split(","))
    p.add_argument("--budgets", default="512,1024,2048,8192",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--ceiling", type=int, default=8192, help="slo's max-num-batched-tokens")
    p.add_argument("--extra", action="append", default=[],
                   help="another column: 'LABEL=engine flags', e.g. "
                        "'fcfs+ctrl=--token-budget slo --max-num-batched-tokens 8192'")
    p.add_argument("--num-requests", type=int, default=1500)
    p.add_argument("--traces", default=SHARED_TRACES)
    p.add_argument("--mooncake-input-scale", type=float, default=0.25,
                   help="Mooncake prompts (median 11.6k, p90 38.6k tokens) are scaled by "
                        "this: at full length most cannot meet 500 ms on one H100 at all")
    p.add_argument("--hardware", default="h100")
    p.add_argument("--slo-ttft", type=float, default=500.0)
    p.add_argument("--slo-tpot", type=float, default=50.0)
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--rate-tolerance", type=float, default=0.01)
    opts = p.parse_args(argv)

    work = workloads(opts)
    cols = configs(opts)
    print(f"capacity per replica (req/s) with >= {opts.attainment:.0%} of requests within "
          f"TTFT <= {opts.slo_ttft:g} ms and TPOT <= {opts.slo_tpot:g} ms; llama3-8b on "
          f"{opts.hardware} (roofline), 256 sequences, {opts.num_requests} requests, rate "
          f"searched to {opts.rate_tolerance:.0%}", flush=True)
    table: dict[str, dict[str, float | None]] = {}
    for name, flags in work.items():
        if isinstance(flags, str):
            print(f"{name}: {flags}")
            continue
        args = parse_sim_args(["--model", "llama3-8b", *flags])
        print(f"{name}: {describe(load_workload(args, 128256))}", flush=True)
        table[name] = {}
        for col in cols:
            value, cpu = search(flags, col, opts)
            table[name][col.label] = value
            print(f"  {col.label:<24} {_fmt(value):>8} req/s   [{cpu:.1f}s cpu]", flush=True)

    fixed = [f"fcfs {b}" for b in opts.budgets]
    slo_label = f"slo {opts.ceiling}"
    header = ["workload", *[c.label for c in cols], "best fixed", "slo / best"]
    rows = []
    for name, values in table.items():
        best = max((values[f] for f in fixed if values[f] is not None), default=None)
        slo = values.get(slo_label)
        ratio = f"{slo / best:.2f}x" if slo and best else "-"
        rows.append([name, *[_fmt(values[c.label]) for c in cols], _fmt(best), ratio])
    print()
    print(_markdown(header, rows))
    return 0


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}" if value < 10 else f"{value:.2f}"


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |",
             "| " + " | ".join(["---"] + ["---:"] * (len(header) - 1)) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
