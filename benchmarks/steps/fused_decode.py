"""Decode steps with the fused decode forward (``runner/fused_decode.py``: one native call
a step) against the modules (``CONVEYOR_FUSED_DECODE=0``), for bf16, int8 and int4
weights, every arm an engine of its own, the arms taking turns in one run.

    python -m benchmarks.steps.fused_decode --model smollm2-135m --batch 1 8

Prints, per batch: each arm's median step (best round), the fused/modules speed-up of
each weight kind, and int8/bf16, int4/bf16 with both sides fused and both on the modules
(the issue's ratio). Engines as ``benchmarks/quant/decode_quant.py`` builds them (dummy
weights, ``context`` prompt tokens each), the bf16 arm's projections pinned to the GEMM on
the bf16 weights (``native-bf16``, what start-up picks on a quiet machine; under load its
measurement may pick torch's float32 linears, which the fused path does not take).
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.common import median_step_s
from benchmarks.quant.decode_quant import VARIANTS as QUANT_VARIANTS
from benchmarks.quant.decode_quant import build
from conveyor import envs
from conveyor.kernels.cpu.cpuinfo import cpu_model_name
from conveyor.runner import fused_decode

VARIANTS = {**QUANT_VARIANTS, "bf16": {"linear_backend": "native-bf16"}}


def build_arm(model: str, batch: int, context: int, steps: int, rounds: int, fused: bool,
              **kw):
    """An engine with the fused path on or off (the switch is read when its KV cache is
    allocated, during the build)."""
    before = os.environ.get(envs.FUSED_DECODE)
    os.environ[envs.FUSED_DECODE] = "1" if fused else "0"
    try:
        llm = build(model, batch, context, steps, rounds, **kw)
    finally:
        if before is None:
            os.environ.pop(envs.FUSED_DECODE)
        else:
            os.environ[envs.FUSED_DECODE] = before
    runner = llm.engine.runner
    if fused and (runner.fused_decode is None or not runner.fused_decode.num_steps):
        raise SystemExit(f"the fused decode path did not run for {model} {kw}")
    return llm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-rows", type=int, default=None,
                   help="the fused path's row limit (default: runner/fused_decode.MAX_ROWS)")
    args = p.parse_args()
    if args.max_rows:
        fused_decode.MAX_ROWS = args.max_rows
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# {args.model}, dummy weights, context {args.context}, "
          f"{torch.get_num_threads()} threads, {cpu_model_name()}")
    quant = [v for v in args.variants if v != "bf16"]
    print("| batch | " + " | ".join(f"{v} {m} ms" for v in args.variants
                                   for m in ("fused", "modules"))
          + " | " + " | ".join(f"{v} fused/modules" for v in args.variants)
          + " | " + " | ".join(f"{v}/bf16 fused | {v}/bf16 modules" for v in quant) + " |")
    for batch in args.batch:
        arms = {(v, f): build_arm(args.model, batch, args.context, args.steps, args.rounds,
                                  f, **VARIANTS[v])
                for v in args.variants for f in (True, False)}
        best = dict.fromkeys(arms, float("inf"))
        for r in range(args.rounds):
            for arm in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                best[arm] = min(best[arm], median_step_s(arms[arm], args.steps))
        cells = [f"{1e3 * best[(v, f)]:.2f}" for v in args.variants for f in (True, False)]
        cells += [f"{best[(v, False)] / best[(v, True)]:.2f}x" for v in args.variants]
        if "bf16" in args.variants:
            cells += [f"{best[('bf16', f)] / best[(v, f)]:.2f}x" for v in quant
                      for f in (True, False)]
        print(f"| {batch} | " + " | ".join(cells) + " |", flush=True)
        del arms


if __name__ == "__main__":
    main()
