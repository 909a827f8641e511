"""One benchmark script run on this tree and on another git revision's whole tree, in
turns within one invocation, so machine drift hits both alike: how a change that must not
move performance (a restructuring) shows it did not.

    python -m benchmarks.against_tree --rev 726acf5 --metric 'decode step\\s+([\\d.]+) ms' \\
        --base-script benchmarks/decode_step.py benchmarks.steps.decode_step -- --rounds 1

REV's tree is extracted with ``git archive`` into a temporary folder and runs with its own
``src`` first on ``PYTHONPATH``. A script is a module (``benchmarks.steps.decode_step``, run
with ``-m`` from the tree's root) or a file path (``benchmarks/decode_step.py``);
``--base-script`` names it in REV's tree when it has moved since. Every number the regex's
first group matches in a run's output is collected; the report prints each side's median
and this tree's median over REV's.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

from benchmarks.common import REPO as ROOT
from benchmarks.common import git_extract


def run_once(tree: str, script: str, args: list[str],
             metrics: list[re.Pattern]) -> list[list[float]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(tree, "src"), tree])}
    how = [script] if script.endswith(".py") else ["-m", script]
    out = subprocess.run([sys.executable, *how, *args], cwd=tree, env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{script} failed in {tree}:\n{out.stdout[-2000:]}{out.stderr[-4000:]}")
    found = [[float(m) for m in metric.findall(out.stdout + out.stderr)] for metric in metrics]
    for metric, values in zip(metrics, found):
        if not values:
            raise SystemExit(f"metric {metric.pattern!r} not found in the output of {script} "
                             f"in {tree}:\n{out.stdout[-2000:]}")
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rev", required=True, help="the git revision to compare against")
    p.add_argument("--metric", required=True, action="append",
                   help="regex; its first group is the number (repeat for several)")
    p.add_argument("--rounds", type=int, default=3, help="turns of (this tree, REV)")
    p.add_argument("--base-script", help="the script's path in REV's tree, if it moved")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    ns = p.parse_args()
    metrics = [re.compile(m) for m in ns.metric]
    args = [a for a in ns.args if a != "--"]
    with tempfile.TemporaryDirectory(prefix="against-") as tmp:
        base = git_extract(ns.rev, tmp)
        here = [[] for _ in metrics]
        there = [[] for _ in metrics]
        for r in range(ns.rounds):
            order = [(ROOT, ns.script, here), (base, ns.base_script or ns.script, there)]
            for tree, script, into in order if r % 2 == 0 else order[::-1]:
                found = run_once(tree, script, args, metrics)
                side = "this tree" if tree == ROOT else ns.rev
                for i, values in enumerate(found):
                    into[i].extend(values)
                    print(f"round {r} {side:>12} [{i}]: {', '.join(f'{v:g}' for v in values)}",
                          flush=True)
    for i, metric in enumerate(metrics):
        a, b = statistics.median(here[i]), statistics.median(there[i])
        print(f"[{i}] {metric.pattern}: median this tree {a:g}, {ns.rev} {b:g}; "
              f"this tree / {ns.rev} = {a / b:.3f}")


if __name__ == "__main__":
    main()
