"""One decode step at batch B against its GEMM-only floor, measured side by side.

The floor times the model's own weight matrices through ``torch.nn.functional.linear``
alone (every layer's packed QKV, O, packed gate/up and down projections, plus the LM
head over B rows): what a step would cost if attention, norms, KV writes, sampling,
Python and scheduling were free. The two are timed alternately, several rounds, so
machine noise hits both. Then a profile splits one step into GEMMs, attention, KV
writes, other tensor ops, and the engine's own Python (scheduling, input building,
sampling bookkeeping).

    python benchmarks/decode_step.py --model smollm2-135m --dtype float32 --batch 32
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.nn.functional as F

from conveyor import LLM, SamplingParams

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm")
ATTENTION_OPS = ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::index",
                 "aten::softmax", "aten::_softmax", "Torch-Compiled Region", "CompiledFunction",
                 "cpp_fused", "aten::masked_fill")
KV_WRITE_OPS = ("aten::index_copy",)


def build(args) -> LLM:
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.batch,
              max_num_batched_tokens=max(2048, args.batch * args.context),
              attention_backend=args.attention_backend, load_format="dummy",
              num_kv_blocks=args.batch * (-(-(args.context + args.steps * 40) // 16)) + 8)
    rng = random.Random(0)
    for i in range(args.batch):
        prompt = [rng.randrange(10, 1000) for _ in range(args.context)]
        llm.engine.add_request({"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=10_000, ignore_eos=True,
                                              temperature=0.0), request_id=str(i))
    while llm.engine.scheduler.num_waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in llm.engine.scheduler.running):
        llm.engine.step()
    llm.engine.step()  # first pure decode step
    return llm


def time_steps(llm: LLM, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def gemm_floor(llm: LLM, batch: int, n: int) -> float:
    model = llm.engine.runner.model
    dtype = model.embed_tokens.weight.dtype
    weights = []
    for layer in model.layers:
        weights += [layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                    layer.mlp.gate_up_proj, layer.mlp.down_proj]
    weights = [(m.weight, m.bias) for m in weights] + [(model.lm_head_weight, None)]
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=dtype) for w, _ in weights}
    times = []
    with torch.inference_mode():
        for _ in range(n):
            t = time.perf_counter()
            for w, b in weights:
                F.linear(inputs[w.shape[1]], w, b)
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def breakdown(llm: LLM, n: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    llm.engine.timings.reset()
    llm.engine.runner.timings.reset()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            llm.engine.step()
    wall = (time.perf_counter() - t) / n
    cats = {"gemm": 0.0, "attention": 0.0, "kv_write": 0.0, "other_tensor_ops": 0.0}
    for evt in prof.key_averages():
        if not evt.key.startswith(("aten::", "cpp_fused", "Torch-Compiled", "CompiledFunction")):
            continue
        self_s = evt.self_cpu_time_total / 1e6 / n
        if evt.key.startswith(GEMM_OPS):
            cats["gemm"] += self_s
        elif evt.key.startswith(KV_WRITE_OPS):
            cats["kv_write"] += self_s
        elif evt.key.startswith(ATTENTION_OPS):
            cats["attention"] += self_s
        else:
            cats["other_tensor_ops"] += self_s
    phases = llm.engine.timings.mean_ms()
    runner = llm.engine.runner.timings.mean_ms()
    cats["python_and_scheduling"] = max(0.0, wall - sum(cats.values()))
    cats["(step wall)"] = wall
    cats["(of which schedule+update+outputs)"] = sum(
        phases.get(k, 0.0) for k in ("schedule", "update", "outputs")) / 1e3
    cats["(of which input prep)"] = runner.get("prepare", 0.0) / 1e3
    return cats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=10, help="decode steps timed per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--attention-backend", default="auto", choices=("auto", "sdpa", "compiled"))
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = build(args)
    print(f"model {args.model} {args.dtype}, batch {args.batch}, context {args.context}+, "
          f"attention {args.attention_backend}, {torch.get_num_threads()} threads")
    ratios = []
    for r in range(args.rounds):
        step = time_steps(llm, args.steps)
        floor = gemm_floor(llm, args.batch, args.steps)
        ratios.append(step / floor)
        print(f"round {r}: decode step {step * 1e3:7.1f} ms   GEMM floor {floor * 1e3:7.1f} ms"
              f"   ratio {step / floor:5.2f}")
    print(f"median ratio step / GEMM floor: {statistics.median(ratios):.2f}")
    print("breakdown of one step (ms):")
    for name, sec in breakdown(llm, args.steps).items():
        print(f"  {name:36s} {sec * 1e3:8.2f}")


if __name__ == "__main__":
    main()
