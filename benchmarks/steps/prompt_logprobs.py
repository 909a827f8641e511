"""Prefill throughput with and without prompt logprobs, side by side.

The engine (offline, dummy weights) prefills one prompt of ``--tokens`` in one step,
asking for no prompt logprobs, and for each k of ``--ks`` through each ``--impl`` (torch:
torch's passes over each slice of logits; fused: the row kernel
``kernels/cpu/logprob_rows.c``); the modes alternate within each round (drift hits them
alike) and each mode's median step is set against the no-logprobs one. The LM head's GEMM
over the scored rows alone is timed in the same rounds: ``1 + head / step`` is the floor
any implementation of exact prompt logprobs pays (every logit of every position).

``--shape smollm2-135m`` is SmolLM2-135M (its tied head is 27% of its non-embedding
weights); ``--shape llama3-8b-head-share`` is Llama-3-8B's layer (hidden 4096,
intermediate 14336, 32/8 heads) with ``--layers`` of them and the vocabulary cut to
128256 * layers / 32, so the head is the same 7.5% share of the weights (and of the
projection FLOPs per token) as in the 8B model, at a size this CPU runs.
What requests that do not ask pay is this tree's no-logprobs step against another tree's
(``benchmarks.against_tree``).

    python -m benchmarks.steps.prompt_logprobs --rounds 5
    python -m benchmarks.steps.prompt_logprobs --shape llama3-8b-head-share --tokens 512 --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import time

import torch

from conveyor import LLM, SamplingParams, envs
from conveyor.config.presets import preset_config, write_checkpoint_files
from conveyor.kernels.cpu.cpuinfo import cpu_model_name
from conveyor.runner import model_runner
from conveyor.runner.prompt_logprobs import SLICE_ROWS, compute_prompt_logprobs


def model_path(shape: str, layers: int = 1) -> str:
    """A preset's name, or a folder: ``llama3-8b-head-share`` (``layers`` of Llama-3-8B's,
    the vocabulary cut to keep its head's share) or ``llama3-8b-head`` (one layer and
    Llama-3-8B's whole 128256 x 4096 head)."""
    if shape == "smollm2-135m":
        return shape
    vocab = 128256 * layers // 32 if shape == "llama3-8b-head-share" else 128256
    cfg = {**preset_config("llama3-8b"), "num_hidden_layers": layers, "vocab_size": vocab,
           "torch_dtype": "float32"}
    path = os.path.join(envs.cache_root(), "presets", f"{shape}-{layers}-{vocab}")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        write_checkpoint_files(path, cfg)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="smollm2-135m",
                   choices=("smollm2-135m", "llama3-8b-head-share"))
    p.add_argument("--layers", type=int, default=1, help="llama3-8b-head-share's layers")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ks", default="1,5", help="the prompt_logprobs values to time")
    p.add_argument("--impl", default="torch,fused", help="torch, fused or both")
    p.add_argument("--slice-rows", type=int, default=SLICE_ROWS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tokens = args.tokens
    llm = LLM(model_path(args.shape, args.layers), dtype=args.dtype, max_num_seqs=8,
              max_num_batched_tokens=tokens, load_format="dummy", enable_prefix_caching=False)
    engine = llm.engine
    model = engine.runner.model
    vocab = model.cfg.vocab_size
    rng = random.Random(0)
    Mode = tuple[str, int] | None
    modes: list[Mode] = [None, *((impl, int(k)) for k in args.ks.split(",")
                                 for impl in args.impl.split(","))]
    impls = {impl: functools.partial(compute_prompt_logprobs, slice_rows=args.slice_rows,
                                     use_kernel=impl == "fused")
             for impl in args.impl.split(",")}

    def one_step(tag: str, mode: Mode) -> float:
        if mode is not None:  # the runner calls the module's name: point it at the impl
            model_runner.compute_prompt_logprobs = impls[mode[0]]
        ids = [rng.randrange(10, vocab - 10) for _ in range(tokens)]
        engine.add_request({"prompt_token_ids": ids},
                           SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0,
                                          prompt_logprobs=None if mode is None else mode[1]),
                           request_id=tag)
        t = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t
        while engine.has_unfinished_requests():
            engine.step()
        return wall

    hidden = torch.randn(tokens - 1, model.cfg.hidden_size).to(model.embed_tokens.weight.dtype)

    @torch.inference_mode()
    def head_gemm() -> float:
        t = time.perf_counter()
        for lo in range(0, tokens - 1, args.slice_rows):
            model.compute_logits(hidden[lo:lo + args.slice_rows])
        return time.perf_counter() - t

    for mode in modes:
        one_step(f"warmup-{mode}", mode)
    head_gemm()
    walls: dict[Mode, list[float]] = {m: [] for m in modes}
    heads: list[float] = []
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            walls[mode].append(one_step(f"r{r}-{mode}", mode))
        heads.append(head_gemm())
    base = statistics.median(walls[None])
    head = statistics.median(heads)
    print(f"CPU: {cpu_model_name()}, {args.shape}" + (
        f" ({args.layers} layers, vocab {vocab})" if args.shape != "smollm2-135m" else "")
        + f", {args.dtype}, {args.threads} threads, one {tokens}-token prompt per step, "
        f"slices of {args.slice_rows} rows, median of {args.rounds} (modes alternate "
        f"within a round)")
    for mode in modes:
        wall = statistics.median(walls[mode])
        name = "no prompt logprobs" if mode is None else f"prompt_logprobs={mode[1]} {mode[0]}"
        print(f"  {name:28s} step {wall * 1e3:8.1f} ms  {tokens / wall:8.0f} tokens/s  "
              f"{wall / base:.3f}x  (steps {', '.join(f'{w * 1e3:.0f}' for w in walls[mode])})")
    print(f"  LM head GEMM over the {tokens - 1} scored rows alone: {head * 1e3:.1f} ms = "
          f"{head / base:.3f} of the no-logprobs step (floor: {1 + head / base:.3f}x)")


if __name__ == "__main__":
    main()
