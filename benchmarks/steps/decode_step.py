"""One decode step at batch B against its GEMM-only floor, measured side by side.

The floor times the model's own weight matrices through ``torch.nn.functional.linear``
alone (every layer's packed QKV, O, packed gate/up and down projections, plus the LM
head over B rows): what a step would cost if attention, norms, KV writes, sampling,
Python and scheduling were free. The two are timed alternately, several rounds, so
machine noise hits both. Then a profile splits one step into GEMMs, attention, KV
writes, other tensor ops, and the engine's own Python (scheduling, input building,
sampling bookkeeping).

    python -m benchmarks.steps.decode_step --model smollm2-135m --dtype float32 --batch 32

``--attention-against REV`` also times each round's steps with git revision REV's decode
attention kernel swapped in (the native backend's library), alternated with this tree's:
a kernel change's effect on the whole step, in one process. ``--gemm-against REV`` does
the same for the native GEMM (``gemm.c``; the steps whose linears are native).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.common import median_step_s, start_decoding
from conveyor import LLM

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise")


def build(args) -> LLM:
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.batch,
              max_num_batched_tokens=max(2048, args.batch * args.context),
              attention_backend=args.attention_backend, linear_backend=args.linear_backend,
              load_format="dummy",
              num_kv_blocks=args.batch * (-(-(args.context + args.steps * 40) // 16)) + 8)
    start_decoding(llm, args.batch, args.context, max_tokens=10_000)
    return llm


def floor_weights(llm: LLM) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Random weights (and biases) of the model's own GEMM shapes: every layer's packed
    QKV, O, packed gate/up and down projections, and the LM head."""
    cfg = llm.engine.config.model
    dtype = llm.engine.runner.model.embed_tokens.weight.dtype
    h, q, kv, inter = (cfg.hidden_size, cfg.num_heads * cfg.head_dim,
                       cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size)
    qkv_bias = cfg.architecture == "Qwen2ForCausalLM"
    gen = torch.Generator().manual_seed(0)

    def w(out: int, inp: int, bias: bool = False):
        return (torch.randn(out, inp, generator=gen).mul_(0.02).to(dtype),
                torch.zeros(out, dtype=dtype) if bias else None)

    layer = [w(q + 2 * kv, h, qkv_bias), w(h, q), w(2 * inter, h), w(h, inter)]
    return layer * cfg.num_layers + [w(cfg.vocab_size, h)]


def linear_fns(weights, backend: str = "torch") -> list:
    """One callable per weight: F.linear (``torch``, the issue's floor) or the weight
    pre-packed once for ``onednn`` or conveyor's ``native`` GEMM (plain products, no fused
    activation): the engine's own GEMMs on a float32 CPU."""
    from conveyor.model.linear.packing import packed_linear

    if backend == "torch":
        return [lambda x, w=w, b=b: F.linear(x, w, b) for w, b in weights]
    return [packed_linear(w, b, backend) for w, b in weights]


def gemm_floor(fns: list, weights, batch: int, n: int) -> float:
    """Median time of one pass of ``fns`` (``linear_fns(weights)``) at ``batch`` rows."""
    dtype = weights[0][0].dtype
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=dtype) for w, _ in weights}
    shapes = [w.shape[1] for w, _ in weights]
    times = []
    with torch.inference_mode():
        for _ in range(n):
            t = time.perf_counter()
            for fn, k in zip(fns, shapes):
                fn(inputs[k])
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def breakdown(llm: LLM, n: int) -> dict[str, float]:
    """Per-step milliseconds by category.

    GEMMs come from the profiler (aten::mm/addmm and oneDNN self time) plus the time spent
    in conveyor's native GEMM kernel (timed by wrapping its module). Attention (the fused kernel or
    gather + SDPA) and KV writes are timed by wrapping the layer's attention call, since
    compiled kernels do not show up as aten ops. Other tensor ops are the rest of the
    forward pass; sampling is the runner's logits + sample phase; Python and scheduling are
    everything outside the forward pass.
    """
    from torch.profiler import ProfilerActivity, profile

    from conveyor.model.linear.native import NativeLinear
    from conveyor.model.models import decoder as llama

    spent = {"attention": 0.0, "kv_write": 0.0, "native_gemm": 0.0}
    real_attention = llama.paged_attention
    real_native = NativeLinear.forward

    def timed_native(self, x):
        t0 = time.perf_counter()
        out = real_native(self, x)
        spent["native_gemm"] += time.perf_counter() - t0
        return out

    def timed_attention(q, k, v, k_cache, v_cache, meta, scale, softcap=None):
        t0 = time.perf_counter()
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        t1 = time.perf_counter()
        out = real_attention(q, k, v, k_cache, v_cache, meta, scale, softcap)  # same data
        spent["kv_write"] += t1 - t0
        spent["attention"] += time.perf_counter() - t1 - (t1 - t0)
        return out

    llm.engine.timings.reset()
    llm.engine.runner.timings.reset()
    llama.paged_attention = timed_attention
    NativeLinear.forward = timed_native
    try:
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(n):
                llm.engine.step()
        wall = (time.perf_counter() - t) / n
    finally:
        llama.paged_attention = real_attention
        NativeLinear.forward = real_native
    gemm = sum(e.self_cpu_time_total for e in prof.key_averages()
               if e.key.startswith(GEMM_OPS)) / 1e6 / n + spent["native_gemm"] / n
    ms = llm.engine.runner.timings.mean_ms()
    forward, logits, sample, prep = (ms.get(k, 0.0) / 1e3
                                     for k in ("forward", "logits", "sample", "prepare"))
    attention, kv_write = spent["attention"] / n, spent["kv_write"] / n
    layer_gemm = max(0.0, gemm - logits)  # the LM head is the logits phase's one GEMM
    return {
        "gemm (layers)": layer_gemm,
        "gemm (LM head)": logits,
        "attention": attention,
        "kv_write": kv_write,
        "other_tensor_ops": max(0.0, forward - layer_gemm - attention - kv_write),
        "sampling": sample,
        "input_prep": prep,
        "python_and_scheduling": max(0.0, wall - forward - logits - sample - prep),
        "(step wall)": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=10, help="decode steps timed per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--attention-backend", default="auto", choices=("auto", "native", "sdpa"))
    p.add_argument("--linear-backend", default="auto",
                   choices=("auto", "torch", "onednn", "native", "native-bf16"))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--attention-against", metavar="REV",
                   help="also time the step with this git revision's decode attention kernel")
    p.add_argument("--gemm-against", metavar="REV",
                   help="also time the step with this git revision's native GEMM")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = build(args)
    runner = llm.engine.runner
    packed = runner.linear_backend if runner.packed_linears else None
    print(f"model {args.model} {args.dtype} (compute {llm.engine.config.model.math_dtype}), "
          f"batch {args.batch}, context {args.context}+, attention {args.attention_backend}, "
          f"linears {packed + ' (packed)' if packed else 'torch F.linear'}, "
          f"{torch.get_num_threads()} threads")
    weights = floor_weights(llm)
    plain_fns = linear_fns(weights)
    packed_fns = linear_fns(weights, packed) if packed else None
    ratios, packed_ratios, against = [], [], []
    if args.attention_against:
        import tempfile

        from benchmarks.common import build_at

        if not hasattr(runner.decode_kernel, "lib"):
            raise SystemExit("--attention-against needs the native decode attention backend")
        libs = (runner.decode_kernel.lib,
                build_at(args.attention_against, "decode_attention.c", tempfile.mkdtemp()))
    if args.gemm_against:
        from benchmarks.common import gemm_at
        from conveyor.kernels.cpu import ops

        gemms = (ops._lib or ops._native(), gemm_at(args.gemm_against))
    rev = args.attention_against or args.gemm_against
    what = "decode attention" if args.attention_against else "GEMM"
    for r in range(args.rounds):
        if args.attention_against:
            runner.decode_kernel.lib = libs[1]
            other = median_step_s(llm, args.steps)
            runner.decode_kernel.lib = libs[0]
        elif args.gemm_against:
            ops._lib = gemms[1]
            other = median_step_s(llm, args.steps)
            ops._lib = gemms[0]
        step = median_step_s(llm, args.steps)
        if rev:
            against.append(other / step)
            print(f"round {r}: decode step {step * 1e3:7.1f} ms, with {rev}'s {what} "
                  f"{other * 1e3:7.1f} ms: {other / step:.3f}x")
        floor = gemm_floor(plain_fns, weights, args.batch, args.steps)
        line = (f"round {r}: decode step {step * 1e3:7.1f} ms   GEMM floor (F.linear) "
                f"{floor * 1e3:7.1f} ms   ratio {step / floor:5.2f}")
        ratios.append(step / floor)
        if packed:
            pfloor = gemm_floor(packed_fns, weights, args.batch, args.steps)
            packed_ratios.append(step / pfloor)
            line += f"   packed floor {pfloor * 1e3:7.1f} ms   ratio {step / pfloor:5.2f}"
        print(line)
    print(f"median ratio step / GEMM floor (F.linear): {statistics.median(ratios):.2f}")
    if against:
        print(f"median ratio step with {rev}'s {what} / this tree's: "
              f"{statistics.median(against):.3f}")
    if packed_ratios:
        print(f"median ratio step / packed {packed} floor: "
              f"{statistics.median(packed_ratios):.2f}")
    print("breakdown of one step (ms):")
    for name, sec in breakdown(llm, args.steps).items():
        print(f"  {name:36s} {sec * 1e3:8.2f}")


if __name__ == "__main__":
    main()
