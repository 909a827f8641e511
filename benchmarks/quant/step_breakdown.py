"""Where a decode step's time goes, for bf16, int8 and int4 weights: the step's total and
its parts (projections, attention, the elementwise kernels, the LM head, and the rest:
the layers' Python, the scheduler, the sampler), each summed over the step's calls.

    python -m benchmarks.quant.step_breakdown --model smollm2-135m --batch 1
    python -m benchmarks.quant.step_breakdown --model qwen3-0.6b --batch 1 --threads 1

Each part is timed by wrapping its Python entry point (a few hundred nanoseconds a call
added to the step). With ``--threads 1`` the clock is the thread's CPU time, which
another process's load inflates far less than wall time does; with more threads, wall
time. Engines as ``decode_quant.py`` builds them (dummy weights, ``context`` prompt
tokens each); rounds of ``steps`` steps, variants in turns, the round with the fastest
median step reported.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from benchmarks.quant.decode_quant import VARIANTS, build
from conveyor.kernels.cpu.cpuinfo import cpu_model_name

PARTS = collections.Counter()


def _wrap(owner, name: str, label: str, clock) -> None:
    fn = getattr(owner, name)

    def timed(*args, **kwargs):
        t = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            PARTS[label] += clock() - t

    setattr(owner, name, timed)


def instrument(clock) -> None:
    """Time each part's entry point (projections: the modules' forward, the LM head's
    included, which ``compute_logits`` reports apart)."""
    from conveyor.model.layers import ops
    from conveyor.model.linear import native
    from conveyor.model.models import decoder
    from conveyor.model.quant import linear as quant

    _wrap(quant.NativeQuantLinear, "forward", "projections + LM head", clock)
    _wrap(native.NativeLinear, "forward", "projections + LM head", clock)
    _wrap(decoder, "paged_attention", "attention (KV write + kernel)", clock)
    for name in ("add_rms_norm", "rms_norm", "rope_", "silu_mul"):
        _wrap(ops.NativeOps, name, f"elementwise: {name}", clock)
    _wrap(decoder.DecoderForCausalLM, "compute_logits", "LM head (compute_logits)", clock)
    _wrap(decoder.DecoderForCausalLM, "forward", "model forward (layers)", clock)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    instrument(clock)
    llms = {v: build(args.model, args.batch, args.context, args.steps, args.rounds,
                     **VARIANTS[v]) for v in args.variants}
    best: dict[str, tuple[float, dict[str, float]]] = {}
    for r in range(args.rounds):
        for v in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
            PARTS.clear()
            times = []
            for _ in range(args.steps):
                t = clock()
                llms[v].engine.step()
                times.append(clock() - t)
            med = statistics.median(times)
            if v not in best or med < best[v][0]:
                best[v] = (med, {k: s / args.steps for k, s in PARTS.items()})
    print(f"# {args.model}, batch {args.batch}, context {args.context}, {args.threads} "
          f"threads ({'thread CPU' if args.threads == 1 else 'wall'} time), "
          f"{cpu_model_name()}; ms per step (share of the step)")
    labels = sorted({k for _, parts in best.values() for k in parts})
    print("| part | " + " | ".join(best) + " |")
    print("|---|" + "---:|" * len(best))
    print("| **step** | " + " | ".join(f"**{1e3 * best[v][0]:.2f}**" for v in best) + " |")
    for label in labels:
        cells = []
        for v in best:
            step, parts = best[v]
            ms = 1e3 * parts.get(label, 0.0)
            cells.append(f"{ms:.2f} ({100 * ms / (1e3 * step):.0f}%)")
        print(f"| {label} | " + " | ".join(cells) + " |")
    print("\n(projections + LM head includes the LM head; model forward includes the "
          "projections, attention and elementwise parts; the step's rest beyond model "
          "forward and compute_logits is the scheduler, input preparation and sampling)")


if __name__ == "__main__":
    main()
