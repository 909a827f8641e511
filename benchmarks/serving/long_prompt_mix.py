"""A long prompt among short ones, for real on this CPU: ``conveyor bench`` (in-process
engine, dummy weights, real arrival times), this tree against another revision's,
interleaved so that machine drift hits both alike.

    PYTHONPATH=src python -m benchmarks.serving.long_prompt_mix --before d34223d --rounds 2

The workload: one ``--long``-token prompt at t=0 and ``--num-short`` short prompts
(``--short-len`` tokens) arriving every ``--gap-s`` seconds from ``--gap-s`` on; every
request generates ``--output-len`` tokens. The default gap puts every short arrival
within the first step (a 512-token step of the default model takes well over 0.3 s on a
2-core CPU), so they all wait while the long prompt is prefilled and the figures count
steps, whatever the machine's speed or load. Reported per run and as medians over the
rounds: the short prompts' TTFT p50 and max, the long prompt's TTFT, and this tree's
medians over ``--before``'s (the ratio the prefill split is about: short TTFT well below
1, long TTFT near 1).

``--before`` is a git revision (its ``src`` is extracted into a temporary folder) or a
``src`` folder. Options after ``--`` go to ``conveyor bench`` in both trees (e.g.
``-- --scheduling-policy sjf``); without ``--before``, only this tree runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from benchmarks.common import REPO, git_extract


def write_workload(path: str, args: argparse.Namespace) -> None:
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens", f"0.0,{args.long},{args.output_len}"]
    rows += [f"{args.gap_s * (i + 1):.3f},{args.short_len},{args.output_len}"
             for i in range(args.num_short)]
    with open(path, "w") as f:
        f.write("\n".join(rows) + "\n")


def run_bench(src: str, workload: str, args: argparse.Namespace, extra: list[str],
              tmp: str) -> dict[str, float]:
    out = os.path.join(tmp, "bench.json")
    cmd = [sys.executable, "-m", "conveyor.entrypoints.cli", "bench", "--model", args.model,
           "--load-format", "dummy", "--num-threads", str(args.num_threads),
           "--workload", workload, "--out", out, *extra]
    env = dict(os.environ, PYTHONPATH=src)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"bench failed in {src}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    with open(os.path.join(tmp, "bench.records.jsonl")) as f:
        records = [json.loads(line) for line in f]
    failed = [r["request_id"] for r in records if r.get("error") or r.get("ttft_s") is None]
    if failed:
        raise SystemExit(f"requests failed in {src}: {failed}")
    short = sorted(r["ttft_s"] for r in records if r["prompt_tokens"] < args.long)
    long_ = [r["ttft_s"] for r in records if r["prompt_tokens"] >= args.long]
    return {"short_p50": statistics.median(short), "short_max": max(short),
            "long": max(long_)}


def fmt(m: dict[str, float]) -> str:
    return (f"short TTFT p50 {m['short_p50'] * 1e3:8.0f} ms  max {m['short_max'] * 1e3:8.0f} ms"
            f" | long TTFT {m['long'] * 1e3:8.0f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", default=None, help="a git revision or a src folder")
    p.add_argument("--rounds", type=int, default=2, help="turns of (before, this tree)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--long", type=int, default=4096, help="the long prompt's tokens")
    p.add_argument("--num-short", type=int, default=6)
    p.add_argument("--short-len", type=int, default=150)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--gap-s", type=float, default=0.05)
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    with tempfile.TemporaryDirectory(prefix="long-mix-") as tmp:
        workload = os.path.join(tmp, "mix.csv")
        write_workload(workload, args)
        trees = [("after", os.path.join(REPO, "src"))]
        if args.before:
            before = args.before
            if not os.path.isdir(before):
                before = git_extract(args.before, tmp, "src")
            trees.insert(0, ("before", before))
        results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
        for rnd in range(args.rounds):
            for name, src in trees:
                m = run_bench(src, workload, args, extra, tmp)
                results[name].append(m)
                print(f"round {rnd + 1} {name:6s} {fmt(m)}", flush=True)
        med = {name: {k: statistics.median(m[k] for m in runs) for k in runs[0]}
               for name, runs in results.items()}
        for name, m in med.items():
            print(f"median  {name:6s} {fmt(m)}")
        if "before" in med:
            a, b = med["after"], med["before"]
            print(f"after/before: short TTFT p50 {a['short_p50'] / b['short_p50']:.3f}x, "
                  f"max {a['short_max'] / b['short_max']:.3f}x, long TTFT "
                  f"{a['long'] / b['long']:.3f}x")


if __name__ == "__main__":
    main()
