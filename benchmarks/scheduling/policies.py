"""Scheduling policies under saturation: what each one wins and what it costs.

    python -m benchmarks.scheduling.policies   # both traces, wall clock
    python -m benchmarks.scheduling.policies --clock model --step-cost 0.00103,1.2e-05,7.4e-05
                                                           # deterministic virtual time
    python -m benchmarks.scheduling.policies --traces azure --num-requests 60   # a quick look

For each trace (the Azure 2023 conversation CSV and the Mooncake synthetic JSONL from
the shared traces folder, skipped when absent), a seeded random sample is scaled to
this CPU and labelled, once, with a tenant mix (``heavy`` sends 10x the rate of each of
``light1..3``), a priority mix (20% class 0, the urgent one; 80% class 1) and the SLO
targets. Then, in one process, with a fresh engine per run:

1. capacity: the sample all at t=0 under fcfs; completed requests/s is the capacity.
2. the sample replayed at ``--load`` x capacity (the trace's own arrival shape,
   rescaled), once per policy: the engine is saturated and a queue builds, which is
   where a policy has something to decide.
3. unloaded references, same engine and arrival times with the rest of the traffic
   removed: the urgent class alone (under priority), the light tenants alone (under
   fair).

Printed: one table per trace (mean / p50 / p99 TTFT and E2E, output tokens/s,
preemptions, goodput under the SLO), the priority and fairness breakdowns, and
PASS/FAIL lines for the expectations of issue 5. Written to ``--out``: a JSON of every
summary and breakdown, per-request records, a share-of-service PNG per trace (fcfs
next to fair) and latency CDFs. Every policy run is also ``conveyor bench`` with the
printed options (the rate is the one measured here).

sjf runs with ``--sjf-aging-s`` and ``--sjf-prompt-weight`` as given here (600 s, 1/16;
the engine's defaults are 0, no aging, and 1). Its default predictor reads
``max_tokens``, which the bench sets to the forced output length: that is an oracle.
``sjf-w1`` prices prompt and output tokens alike (weight 1); ``sjf-noout`` uses a
predictor that knows nothing about the output (every request expects one token), i.e.
it orders by prompt length.

``--clock model`` replays in virtual time (bench/model_clock.py): each step costs what a
linear model fitted to a wall-clock run (or ``--step-cost``) says, so the comparison is
deterministic even on a busy machine. Wall clock is the default and what to quote.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shlex
import sys
import time
from dataclasses import dataclass, field

from benchmarks.common import REPO, traces_dir
from conveyor.bench.breakdown import (
    by_priority,
    by_tenant,
    latency_by,
    service_timeline,
)
from conveyor.bench.cli import parse_bench_args, vocab_size_of
from conveyor.bench.engine_backend import run_engine
from conveyor.bench.metrics import RunResult
from conveyor.bench.report import fmt, save_records, table
from conveyor.bench.workload import BenchRequest, describe, load_workload
from conveyor.config import EngineArgs
from conveyor.core.policies import register_predictor
from conveyor.costs.linear import LinearStepCost

TRACES_DIR = traces_dir()


@dataclass(frozen=True)
class TraceSpec:
    file: str
    input_scale: float
    output_scale: float
    max_input_len: int | None = None


# Scaled so that a request costs the tiny model a few tens of steps: Azure prompts
# median ~128 / outputs median ~32 tokens; Mooncake prompts median ~360 (its 512-token
# prefix blocks become 16 tokens, one KV block, so prefix sharing survives), outputs
# median ~35.
TRACES = {
    "azure": TraceSpec("azure_conv_2023.csv", 0.125, 0.25),
    "mooncake": TraceSpec("mooncake_synthetic.jsonl", 1 / 32, 0.5, max_input_len=1536),
}
HEAVY = "heavy"
LIGHTS = ("light1", "light2", "light3")
TENANT_MIX = f"{HEAVY}=10," + ",".join(f"{t}=1" for t in LIGHTS)
URGENT, LOW = 0, 1
PRIORITY_MIX = f"{URGENT}=0.2,{LOW}=0.8"


# An sjf predictor that knows nothing of the output: remaining work is the prompt.
def _no_output_knowledge(request) -> int:
    return 1


register_predictor("no-output", _no_output_knowledge)


@dataclass
class PolicyRun:
    label: str
    policy: str
    engine_flags: list[str] = field(default_factory=list)  # conveyor bench flags
    overrides: dict = field(default_factory=dict)  # EngineArgs fields no flag can set


def policy_runs(aging_s: float, prompt_weight: float) -> list[PolicyRun]:
    aging = ["--sjf-aging-s", f"{aging_s:g}"]
    weighted = [*aging, "--sjf-prompt-weight", f"{prompt_weight:g}"]
    return [
        PolicyRun("fcfs", "fcfs"),
        PolicyRun("sjf", "sjf", weighted),
        PolicyRun("sjf-w1", "sjf", aging),
        PolicyRun("sjf-noout", "sjf", weighted, {"sjf_predictor": "no-output"}),
        PolicyRun("priority", "priority"),
        PolicyRun("fair", "fair"),
        # fair as plain VTC: no admission preemption, no rejoin credit (the cost of both).
        PolicyRun("fair-vtc", "fair", ["--fair-preempt-gap", "off",
                                       "--fair-rejoin-credit", "0"]),
        PolicyRun("edf", "edf"),
        PolicyRun("lpm", "lpm"),
    ]


# ---- one trace --------------------------------------------------------------------------
@dataclass
class TraceStudy:
    name: str
    base_argv: list[str]
    capacity: RunResult
    rate: float
    runs: dict[str, RunResult]
    urgent_alone: RunResult
    lights_alone: RunResult
    commands: dict[str, str]
    cost_model: LinearStepCost | None = None


def prompt_token_cost(model: LinearStepCost) -> float:
    """One more prompt token in a step over one more output token (a request's decode
    step: a sequence and a token), under the step cost model."""
    return model.per_token_s / (model.per_token_s + model.per_seq_s)


def base_argv(args: argparse.Namespace, spec: TraceSpec) -> list[str]:
    argv = ["--model", args.model, "--load-format", "dummy", "--dtype", "float32",
            "--num-threads", str(args.num_threads),
            "--workload", os.path.join(TRACES_DIR, spec.file), "--sample", "random",
            "--num-requests", str(args.num_requests), "--seed", str(args.seed),
            "--input-scale", f"{spec.input_scale:g}", "--output-scale",
            f"{spec.output_scale:g}", "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--tenants", TENANT_MIX, "--priorities", PRIORITY_MIX,
            "--slo-ttft", f"{args.slo_ttft_ms:g}", "--slo-tpot", f"{args.slo_tpot_ms:g}"]
    if spec.max_input_len:
        argv += ["--max-input-len", str(spec.max_input_len)]
    return argv


def engine_args(argv: list[str], run: PolicyRun | None = None) -> EngineArgs:
    flags = [] if run is None else ["--scheduling-policy", run.policy, *run.engine_flags]
    ea = EngineArgs.from_cli_args(parse_bench_args(argv + flags))
    return dataclasses.replace(ea, **run.overrides) if run is not None else ea


def load(argv: list[str], rate: float) -> list[BenchRequest]:
    args = parse_bench_args(argv + ["--request-rate", f"{rate:g}"])
    return load_workload(args, vocab_size_of(args))


def study_trace(name: str, spec: TraceSpec, args: argparse.Namespace) -> TraceStudy:
    argv = base_argv(args, spec)
    print(f"\n=== {name}: {spec.file}")
    cap_reqs = load(argv, math.inf)
    print(f"workload: {describe(cap_reqs)}")
    cost_model = None
    if args.clock == "model":
        cost_model = args.step_cost
        if cost_model is None:
            calib = run_engine(cap_reqs, engine_args(argv), label="calibration", progress=False)
            cost_model = LinearStepCost.fit(calib.step_trace)
            print(f"step cost fitted to a wall-clock run ({calib.summary.duration_s:.1f} s): "
                  f"{cost_model.describe()} (base, per token, per request; seconds)")
        argv = argv + ["--step-cost", cost_model.describe()]
    capacity = run_engine(cap_reqs, engine_args(argv), label="capacity", progress=False,
                          cost_model=cost_model)
    if cost_model is not None or len(capacity.step_trace) >= 3:
        fitted = cost_model or LinearStepCost.fit(capacity.step_trace)
        print(f"a prompt token costs {prompt_token_cost(fitted):.3f} of an output token "
              f"(step cost {fitted.describe()}); sjf runs with --sjf-prompt-weight "
              f"{args.sjf_prompt_weight:g}, sjf-w1 with 1 (prompt and output tokens alike)")
    cap = capacity.summary.request_throughput
    rate = float(f"{args.load * cap:.4g}")
    print(f"capacity (all {len(cap_reqs)} at t=0, fcfs): {cap:.2f} req/s, "
          f"{capacity.summary.output_throughput:.0f} output tokens/s; offered load "
          f"{args.load:g} x capacity = {rate:g} req/s")
    reqs = load(argv, rate)
    print(f"loaded workload: {describe(reqs)}")
    print("each policy run is: conveyor bench " + shlex.join(argv + ["--request-rate",
                                                                     f"{rate:g}"])
          + " --scheduling-policy NAME [its flags] (all in the JSON)")
    runs, commands = {}, {}
    for run in policy_runs(args.sjf_aging_s, args.sjf_prompt_weight):
        if args.policies and run.label not in args.policies:
            continue
        flags = ["--request-rate", f"{rate:g}", "--scheduling-policy", run.policy,
                 *run.engine_flags]
        commands[run.label] = "conveyor bench " + shlex.join(argv + flags) + \
            (f"  # plus {run.overrides} (set by this script)" if run.overrides else "")
        t = time.perf_counter()
        runs[run.label] = run_engine(reqs, engine_args(argv, run), label=run.label,
                                     progress=False, cost_model=cost_model)
        s = runs[run.label].summary
        print(f"  {run.label:<10} {time.perf_counter() - t:5.1f}s  mean TTFT "
              f"{s.latency['ttft'].mean:7.0f} ms  {s.output_throughput:6.0f} tok/s")
    urgent = [r for r in reqs if r.priority == URGENT]
    urgent_alone = run_engine(urgent, engine_args(argv, PolicyRun("", "priority")),
                              label="urgent-alone", progress=False, cost_model=cost_model)
    lights = [r for r in reqs if r.tenant != HEAVY]
    lights_alone = run_engine(lights, engine_args(argv, PolicyRun("", "fair")),
                              label="lights-alone", progress=False, cost_model=cost_model)
    print(f"  references: {len(urgent)} urgent requests alone, {len(lights)} light-tenant "
          "requests alone")
    return TraceStudy(name, argv, capacity, rate, runs, urgent_alone, lights_alone, commands,
                      cost_model)


# ---- tables -----------------------------------------------------------------------------
def policy_table(st: TraceStudy) -> str:
    rows = []
    for label, res in st.runs.items():
        s = res.summary
        ttft, e2e = s.latency["ttft"], s.latency["e2e"]
        rows.append([label, fmt(ttft.mean), fmt(ttft.median), fmt(ttft.p99), fmt(e2e.mean),
                     fmt(e2e.median), fmt(e2e.p99), fmt(s.output_throughput),
                     fmt(s.num_preemptions), fmt(s.goodput),
                     "-" if s.slo_attainment is None else f"{100 * s.slo_attainment:.0f}%"])
    return table(["policy", "TTFT mean", "p50", "p99", "E2E mean", "p50", "p99",
                  "out tok/s", "preempt", "goodput", "in SLO"], rows)


def priority_breakdown(st: TraceStudy) -> tuple[str, dict]:
    cols = {"alone": st.urgent_alone, **{k: st.runs[k] for k in ("fcfs", "priority")
                                          if k in st.runs}}
    stats = {label: latency_by(res.records, by_priority) for label, res in cols.items()}
    rows, data = [], {}
    for cls, name in ((URGENT, "urgent (0)"), (LOW, "low (1)")):
        row = [name]
        for label in cols:
            ls = stats[label].get(cls)
            row += [fmt(ls.mean), fmt(ls.p99)] if ls else ["-", "-"]
            data[f"{cls}/{label}"] = None if ls is None else dataclasses.asdict(ls)
        rows.append(row)
    header = ["class"] + [f"{label} TTFT {stat}" for label in cols for stat in ("mean", "p99")]
    return table(header, rows), data


def fairness_breakdown(st: TraceStudy, bin_s: float) -> tuple[str, dict]:
    cols = {"alone": st.lights_alone, **{k: st.runs[k] for k in ("fcfs", "fair-vtc", "fair")
                                          if k in st.runs}}
    lights = {label: [r for r in res.records if r.tenant != HEAVY]
              for label, res in cols.items()}
    stats = {label: latency_by(res.records, by_tenant) for label, res in cols.items()}
    pooled = {label: latency_by(recs, lambda r: "lights") .get("lights")
              for label, recs in lights.items()}
    span = max(r.arrival_s for r in st.runs[next(iter(st.runs))].records)
    shares = {label: service_timeline(st.runs[label].records, bin_s).share_between(0, span)
              for label in ("fcfs", "fair") if label in st.runs}
    reqs = st.runs[next(iter(st.runs))].records
    demand = {t: sum(r.tenant == t for r in reqs) / len(reqs) for t in (HEAVY, *LIGHTS)}
    rows, data = [], {"demand": demand, "share_during_arrivals": shares}
    for tenant in (HEAVY, *LIGHTS, "lights"):
        row = [tenant]
        for label in cols:
            ls = pooled[label] if tenant == "lights" else stats[label].get(tenant)
            row += [fmt(ls.mean), fmt(ls.p99)] if ls else ["-", "-"]
            data[f"{tenant}/{label}"] = None if ls is None else dataclasses.asdict(ls)
        for label in shares:
            value = (sum(shares[label].get(t, 0.0) for t in LIGHTS) if tenant == "lights"
                     else shares[label].get(tenant, math.nan))
            row.append(f"{100 * value:.0f}%")
        value = sum(demand[t] for t in LIGHTS) if tenant == "lights" else demand[tenant]
        row.append(f"{100 * value:.0f}%")
        rows.append(row)
    header = (["tenant"] + [f"{label} TTFT {stat}" for label in cols for stat in
                            ("mean", "p99")]
              + [f"{label} share" for label in shares] + ["requests"])
    return table(header, rows), data


def fair_cost(st: TraceStudy) -> str:
    """What fair's admission preemption and rejoin credit cost the heavy tenant and the
    engine, next to plain VTC (fair-vtc) and fcfs."""
    alone = latency_by([r for r in st.lights_alone.records if r.tenant != HEAVY],
                       lambda r: 0)[0].mean
    rows = []
    for label in ("fcfs", "fair-vtc", "fair"):
        if label not in st.runs:
            continue
        res = st.runs[label]
        heavy = [r for r in res.records if r.tenant == HEAVY]
        light = latency_by([r for r in res.records if r.tenant != HEAVY], lambda r: 0)[0]
        e2e = latency_by(heavy, lambda r: 0, "e2e")[0]
        rows.append([label, fmt(light.mean), f"{light.mean / alone:.2f}x",
                     fmt(latency_by(heavy, lambda r: 0)[0].mean), fmt(e2e.mean),
                     fmt(e2e.p99), fmt(res.summary.num_preemptions),
                     fmt(res.summary.output_throughput)])
    return table(["policy", "lights TTFT mean", "vs alone", "heavy TTFT mean",
                  "heavy E2E mean", "heavy E2E p99", "preempt", "out tok/s"], rows)


# ---- expectations -----------------------------------------------------------------------
def checks(st: TraceStudy) -> list[tuple[str, str]]:
    """(PASS | FAIL | INFO, line) for each expectation of issue 5 these runs cover."""
    out = []
    runs = st.runs

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    def ttft_mean(label: str) -> float:
        return runs[label].summary.latency["ttft"].mean

    if "fcfs" in runs:
        f = ttft_mean("fcfs")
        for label, status in (("sjf", None), ("sjf-w1", "INFO"), ("sjf-noout", "INFO")):
            if label in runs:
                s = ttft_mean(label)
                out.append((status or verdict(s <= 0.7 * f),
                            f"{label} cuts mean TTFT vs fcfs by >= 30%: {s:.0f} vs {f:.0f} ms "
                            f"({100 * (s / f - 1):+.0f}%)"))
    if "priority" in runs and "fcfs" in runs:
        alone = latency_by(st.urgent_alone.records, by_priority)[URGENT]
        prio = latency_by(runs["priority"].records, by_priority)
        fcfs = latency_by(runs["fcfs"].records, by_priority)
        u, low = prio[URGENT], prio[LOW]
        out.append((verdict(u.p99 <= 2 * alone.p99),
                    f"priority: urgent p99 TTFT within 2x unloaded: {u.p99:.0f} vs "
                    f"{alone.p99:.0f} ms ({u.p99 / alone.p99:.2f}x)"))
        out.append((verdict(low.mean >= fcfs[LOW].mean and low.p99 > u.p99),
                    f"priority: low class absorbs the delay: low mean TTFT {low.mean:.0f} ms "
                    f"(fcfs {fcfs[LOW].mean:.0f}), low p99 {low.p99:.0f} vs urgent p99 "
                    f"{u.p99:.0f} ms"))
    if "fair" in runs and "fcfs" in runs:
        def lights_mean(res: RunResult) -> float:
            return latency_by([r for r in res.records if r.tenant != HEAVY],
                              lambda r: 0)[0].mean
        alone = lights_mean(st.lights_alone)
        fair, fcfs = lights_mean(runs["fair"]), lights_mean(runs["fcfs"])
        out.append((verdict(fair <= 2 * alone),
                    f"fair: light tenants' mean TTFT within 2x unloaded: {fair:.1f} vs "
                    f"{alone:.1f} ms ({fair / alone:.2f}x)"))
        out.append((verdict(fcfs > 2 * alone),
                    f"fcfs: heavy tenant starves the light ones (> 2x unloaded): {fcfs:.0f} "
                    f"vs {alone:.0f} ms ({fcfs / alone:.0f}x)"))
        if "fair-vtc" in runs:
            vtc = lights_mean(runs["fair-vtc"])
            out.append(("INFO", f"fair-vtc (no admission preemption, no rejoin credit): "
                                f"light tenants' mean TTFT {vtc:.1f} vs {alone:.1f} ms "
                                f"({vtc / alone:.2f}x)"))
        out.append(("INFO", f"fair removes {100 * (fcfs - fair) / (fcfs - alone):.1f}% of the "
                            "TTFT the heavy tenant adds to the light ones under fcfs"))
    return out


# ---- main -------------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", default="azure,mooncake", help=f"of {', '.join(TRACES)}")
    p.add_argument("--policies", default=None,
                   help="comma-separated run labels to keep (default: all)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--load", type=float, default=2.0,
                   help="offered request rate as a multiple of the measured capacity")
    p.add_argument("--sjf-aging-s", type=float, default=600.0,
                   help="sjf aging (the engine's default is 0: no aging)")
    p.add_argument("--sjf-prompt-weight", type=float, default=1 / 16,
                   help="sjf: a prompt token's cost relative to an output token's (the "
                        "engine's default is 1; sjf-w1 runs with 1)")
    p.add_argument("--slo-ttft-ms", type=float, default=500.0)
    p.add_argument("--slo-tpot-ms", type=float, default=25.0)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clock", default="wall", choices=("wall", "model"),
                   help="wall: real time; model: virtual time, each step costing what a "
                        "linear model fitted to a wall-clock run (or --step-cost) says: "
                        "deterministic, for a machine too busy to time policies on")
    p.add_argument("--step-cost", type=LinearStepCost.parse, default=None,
                   metavar="BASE,PER_TOKEN,PER_SEQ",
                   help="--clock model: these constants (seconds) instead of fitting them")
    p.add_argument("--share-bin-s", type=float, default=None,
                   help="time bin of the share-of-service plot (default: a 30th of the "
                        "fcfs run)")
    p.add_argument("--out", default=os.path.join(REPO, "results", "policies"))
    args = p.parse_args()
    args.policies = args.policies.split(",") if args.policies else None
    names = args.traces.split(",")
    unknown = [n for n in names if n not in TRACES]
    if unknown:
        print(f"unknown trace(s) {unknown}; valid: {', '.join(TRACES)}", file=sys.stderr)
        return 2
    print("python -m benchmarks.scheduling.policies " + shlex.join(sys.argv[1:]))
    print("parameters: " + json.dumps(
        {**vars(args), "step_cost": args.step_cost and args.step_cost.describe()}))
    print(f"tenants {TENANT_MIX}; priority classes {PRIORITY_MIX} (0 is urgent); "
          f"SLO TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms")
    t_start = time.perf_counter()
    studies = []
    for name in names:
        path = os.path.join(TRACES_DIR, TRACES[name].file)
        if not os.path.isfile(path):
            print(f"\nskipping {name}: {path} not found (set CONVEYOR_TRACES)")
            continue
        studies.append(study_trace(name, TRACES[name], args))
    if not studies:
        return 2
    report(studies, args)
    print(f"\nwall time {time.perf_counter() - t_start:.0f}s")
    return 0


def share_bin(st: TraceStudy, args: argparse.Namespace) -> float:
    if args.share_bin_s is not None:
        return args.share_bin_s
    return next(iter(st.runs.values())).summary.duration_s / 30


def report(studies: list[TraceStudy], args: argparse.Namespace) -> None:
    from conveyor.bench.plots import plot_latency_cdfs, plot_service_shares

    os.makedirs(args.out, exist_ok=True)
    verdicts, saved = [], {"parameters": vars(args)}
    for st in studies:
        print(f"\n=== {st.name}: {st.rate:g} req/s offered = {args.load:g} x capacity "
              f"{st.capacity.summary.request_throughput:.2f} req/s; TTFT/E2E in ms, goodput "
              f"in req/s meeting TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= "
              f"{args.slo_tpot_ms:g} ms")
        print(policy_table(st))
        entry = {"rate": st.rate,
                 "step_cost": st.cost_model.describe() if st.cost_model else None,
                 "capacity": st.capacity.summary.to_dict(),
                 "runs": {k: r.summary.to_dict() for k, r in st.runs.items()},
                 "commands": st.commands}
        if "priority" in st.runs:
            text, entry["priority"] = priority_breakdown(st)
            print(f"\npriority ({PRIORITY_MIX}): TTFT by class, ms; alone = the urgent "
                  "class replayed without the rest")
            print(text)
        if "fair" in st.runs:
            text, entry["fairness"] = fairness_breakdown(st, share_bin(st, args))
            print(f"\nfairness ({TENANT_MIX}): TTFT by tenant, ms; alone = the light tenants "
                  "replayed without heavy; share = of weighted service while requests arrive")
            print(text)
            print("\nfair's cost: light tenants' mean TTFT (ms, and vs alone), the heavy "
                  "tenant's latency (ms), preemptions and output tokens/s; fair-vtc = fair "
                  "--fair-preempt-gap off --fair-rejoin-credit 0 (plain VTC)")
            print(fair_cost(st))
        if "fair" in st.runs and "fcfs" in st.runs:
            reqs = st.runs["fcfs"].records
            demand = {t: sum(r.tenant == t for r in reqs) / len(reqs) for t in (HEAVY, *LIGHTS)}
            last_arrival = max(r.arrival_s for r in reqs)
            png = plot_service_shares(
                [(f"{st.name}: {label}", service_timeline(st.runs[label].records,
                                                                   share_bin(st, args)))
                 for label in ("fcfs", "fair")],
                os.path.join(args.out, f"share_{st.name}.png"), groups=[HEAVY, *LIGHTS],
                demand=demand, last_arrival_s=last_arrival)
            print(f"share of service over time: {png}")
        cdf = plot_latency_cdfs(list(st.runs.values()),
                                os.path.join(args.out, f"latency_cdf_{st.name}.png"))
        print(f"latency CDFs: {cdf}")
        save_records(os.path.join(args.out, f"records_{st.name}.jsonl"),
                     [st.capacity, *st.runs.values(), st.urgent_alone, st.lights_alone])
        entry["checks"] = []
        for status, line in checks(st):
            verdicts.append(f"{status} [{st.name}] {line}")
            entry["checks"].append({"status": status, "check": line})
        saved[st.name] = entry
    print()
    print("\n".join(verdicts))
    path = os.path.join(args.out, "policies.json")
    with open(path, "w") as f:
        json.dump(saved, f, indent=1, default=str)
    print(f"saved {path}")


if __name__ == "__main__":
    sys.exit(main())
