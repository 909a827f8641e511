"""Short prompts beside long prefills, in the simulator (Llama-3-8B shape, H100 roofline,
default engine settings): TTFT of short and long prompts apart, each policy.

    PYTHONPATH=src python -m benchmarks.sim.long_prefill
    PYTHONPATH=src python -m benchmarks.sim.long_prefill --before /tmp/main/src \\
        --traces /work/shared/traces --num-requests 3000

Scenarios (virtual time, so the figures are the same on any CPU):

- ``long64k``: one 65,536-token prompt at t=0, 30 chats (150-token prompts, 64 output
  tokens) arriving every 100 ms during its prefill;
- ``four16k``: four 16,384-token prompts at t=0, 30 chats arriving every 50 ms;
- with ``--traces DIR``: the Azure conversation and Mooncake traces at their own arrival
  times (the first ``--num-requests`` rows).

Each long prompt's TTFT is also given as a ratio to its TTFT with the same long prompts
and no short ones ("alone"). ``--before SRC`` runs the same on another tree's ``src`` (e.g.
``git worktree add /tmp/main main``) and prints it first. Goodput: requests meeting TTFT
<= 500 ms and TPOT <= 50 ms per second of makespan, and their share.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

POLICIES = ("fcfs", "sjf", "slo", "fair", "lpm", "priority")
ENGINE = ["--model", "llama3-8b", "--load-format", "dummy", "--hardware", "h100",
          "--max-model-len", "70000"]
TTFT_SLO_S, TPOT_SLO_S = 0.5, 0.05


def write_csv(path: str, longs: list[int], shorts: int, gap_s: float) -> None:
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"0.0,{n},16" for n in longs]
    rows += [f"{gap_s * (i + 1):.3f},150,64" for i in range(shorts)]
    with open(path, "w") as f:
        f.write("\n".join(rows) + "\n")


def run_sim(src: str, workload: str, policy: str, extra: list[str],
            tmp: str) -> list[dict]:
    out = os.path.join(tmp, "sim.json")
    args = [sys.executable, "-m", "conveyor.entrypoints.cli", "sim", *ENGINE,
            "--workload", workload, "--scheduling-policy", policy, "--out", out, *extra]
    if policy == "slo":
        args += ["--slo-ttft", str(TTFT_SLO_S * 1e3)]
    env = dict(os.environ, PYTHONPATH=src)
    subprocess.run(args, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(tmp, "sim.records.jsonl")) as f:
        return [json.loads(line) for line in f]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def summarize(records: list[dict], long_above: int, alone: dict[str, float]) -> str:
    num_failed = sum(r["ttft_s"] is None or r["e2e_s"] is None for r in records)
    records = [r for r in records if r["ttft_s"] is not None and r["e2e_s"] is not None]
    short = [r["ttft_s"] for r in records if r["prompt_tokens"] <= long_above]
    long_ = [r for r in records if r["prompt_tokens"] > long_above]
    ends = [r["arrival_s"] + r["e2e_s"] for r in records]
    good = [r for r in records if r["ttft_s"] <= TTFT_SLO_S
            and (r.get("tpot_s") or 0.0) <= TPOT_SLO_S]
    makespan = max(ends) - min(r["arrival_s"] for r in records)
    ratios = [r["ttft_s"] / alone[r["request_id"]] for r in long_ if r["request_id"] in alone]
    lt = [r["ttft_s"] for r in long_]
    ratio = f"{max(ratios):5.2f}x" if ratios else "   - "
    return (f"short p50 {pct(short, .5) * 1e3:7.0f} p99 {pct(short, .99) * 1e3:7.0f} "
            f"max {max(short, default=float('nan')) * 1e3:7.0f} ms | long p50 "
            f"{pct(lt, .5) * 1e3:8.0f} p99 {pct(lt, .99) * 1e3:8.0f} ms, worst/alone "
            f"{ratio} | makespan {makespan:8.2f} s | goodput {len(good) / makespan:6.2f} "
            f"req/s ({len(good) / len(records):4.0%})"
            + (f" | {num_failed} failed" if num_failed else ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", default=None, help="another tree's src directory")
    p.add_argument("--src", default=os.path.abspath("src"), help="this tree's src")
    p.add_argument("--traces", default=None, help="folder with the Azure and Mooncake traces")
    p.add_argument("--num-requests", type=int, default=3000)
    p.add_argument("--long-above", type=int, default=2048,
                   help="traces: prompts longer than this count as long")
    p.add_argument("--policies", default=",".join(POLICIES))
    args, extra = p.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        scenarios = []
        for name, longs, gap in (("long64k", [65536], 0.1), ("four16k", [16384] * 4, 0.05)):
            path, alone = os.path.join(tmp, f"{name}.csv"), os.path.join(tmp, f"{name}-a.csv")
            write_csv(path, longs, 30, gap)
            write_csv(alone, longs, 0, gap)
            scenarios.append((name, path, alone, [], 512))
        if args.traces:
            for trace in ("azure_conv_2023.csv", "mooncake_synthetic.jsonl"):
                path = os.path.join(args.traces, trace)
                if os.path.exists(path):
                    scenarios.append((trace, path, None, ["--num-requests",
                                                          str(args.num_requests)],
                                      args.long_above))
        trees = ([("before", args.before)] if args.before else []) + [("after", args.src)]
        for name, path, alone_path, opts, long_above in scenarios:
            for policy in args.policies.split(","):
                for tree, src in trees:
                    alone = {}
                    if alone_path is not None:
                        alone = {r["request_id"]: r["ttft_s"] for r in
                                 run_sim(src, alone_path, policy, extra, tmp)}
                    records = run_sim(src, path, policy, opts + extra, tmp)
                    print(f"{name:24s} {policy:8s} {tree:6s} "
                          f"{summarize(records, long_above, alone)}", flush=True)


if __name__ == "__main__":
    main()
