"""Decode steps of one model in bf16, int8 and int4 weights, side by side in one run.

Each variant is an engine of the same shape (dummy weights) with ``batch`` requests
prefilled; then rounds of ``steps`` decode steps per variant, the variants taking turns
(so a burst of load on a shared machine hits all of them), the median step of the best
round kept. tokens/s = batch / step.

    python -m benchmarks.quant.decode_quant --model smollm2-135m --batch 1 8 32
    python -m benchmarks.quant.decode_quant --batch 1 --max-num-seqs 128  # as a server

``--max-num-seqs N``: every engine built with that cap (at least ``batch``), as
``conveyor serve`` is (128): the start-up linear choices are then timed at N decode
rows, as a server's are, while the steps run at ``batch``.

bf16 is the bfloat16 checkpoint as conveyor runs it on this CPU (computed in float32
where the CPU lacks bf16 arithmetic, reading bf16 weights: native-bf16); int8 and int4
are ``--quantization int8`` / ``int4`` on the same checkpoint (every projection and the
LM head quantized; kernels measured at start). ``int8-f32`` / ``int8-a16``: int8 with
every quantized linear on ``native-int`` (the float path) / ``native-int8-a16``:

    python -m benchmarks.quant.decode_quant --batch 1 --variants bf16 int8-f32 int8-a16 int8
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.common import median_step_s, start_decoding
from conveyor import LLM
from conveyor.kernels.cpu.cpuinfo import cpu_model_name
from conveyor.model.quant.apply import QUANT_LINEAR

VARIANTS = {"bf16": {}, "int8": {"quantization": "int8"}, "int4": {"quantization": "int4"},
            # int8 with every quantized linear forced onto one backend (an A/B of kernels)
            "int8-f32": {"quantization": "int8", "backend": "native-int"},
            "int8-a16": {"quantization": "int8", "backend": "native-int8-a16"}}


def build(model: str, batch: int, context: int, steps: int, rounds: int,
          max_num_seqs: int = 0, backend: str = "", **kw) -> LLM:
    if backend:  # (read once, when the engine quantizes its linears)
        os.environ[QUANT_LINEAR] = backend
    try:
        return _build(model, batch, context, steps, rounds, max_num_seqs, **kw)
    finally:
        os.environ.pop(QUANT_LINEAR, None)


def _build(model: str, batch: int, context: int, steps: int, rounds: int,
           max_num_seqs: int, **kw) -> LLM:
    llm = LLM(model, dtype="bfloat16", load_format="dummy",
              max_num_seqs=max(batch, max_num_seqs),
              max_num_batched_tokens=max(512, batch * context),
              num_kv_blocks=batch * (-(-(context + steps * rounds + 40) // 16)) + 8, **kw)
    start_decoding(llm, batch, context)
    return llm


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=0,
                   help="the engines' cap (at least the batch): 128 times the start-up "
                        "choices as conveyor serve's default does")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# {args.model}, dummy weights, context {args.context}, "
          f"{torch.get_num_threads()} threads, {cpu_model_name()}"
          + (f", max_num_seqs {args.max_num_seqs}" if args.max_num_seqs else ""))
    print("| batch | " + " | ".join(f"{v} step ms | {v} tok/s" for v in args.variants)
          + " | " + " | ".join(f"{v}/bf16" for v in args.variants if v != "bf16") + " |")
    for batch in args.batch:
        llms = {v: build(args.model, batch, args.context, args.steps, args.rounds,
                         args.max_num_seqs, **VARIANTS[v]) for v in args.variants}
        best = dict.fromkeys(llms, float("inf"))
        for r in range(args.rounds):
            for v in (list(llms) if r % 2 == 0 else list(llms)[::-1]):
                best[v] = min(best[v], median_step_s(llms[v], args.steps))
        cells = [f"{1e3 * best[v]:.2f} | {batch / best[v]:.1f}" for v in llms]
        ratios = [f"{best['bf16'] / best[v]:.2f}x" for v in llms
                  if v != "bf16" and "bf16" in best]
        print(f"| {batch} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |",
              flush=True)
        del llms


if __name__ == "__main__":
    main()
