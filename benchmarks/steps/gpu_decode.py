"""The decode step on a CUDA device against its HBM roofline (the GPU issue's check).

A decode step must read every weight once and every running sequence's KV cache: at
batch B and context C that is ``weight bytes + B x C x kv bytes per token``, and at the
device's memory bandwidth (4.8 TB/s on an H200) no step can be faster. This builds the
model with dummy weights on ``--device cuda``, fills ``B`` sequences of ``--context``
prompt tokens, then times pure decode steps (each ends with the sampled ids on the host:
the engine's own sync) and prints step time, its roofline and their ratio per batch.

    python -m benchmarks.steps.gpu_decode --model llama3-8b --batches 1,8,64,256
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from conveyor import LLM, SamplingParams
from conveyor.costs.hardware import HARDWARE_PRESETS


def weight_bytes(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:  # a tied embedding counts once
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def measure(args, batch: int) -> dict:
    llm = LLM(args.model, dtype=args.dtype, device=args.device, load_format="dummy",
              attention_backend=args.attention_backend,
              max_num_seqs=batch, max_num_batched_tokens=max(8192, args.context),
              max_model_len=args.context + args.steps + 32,
              num_kv_blocks=batch * -(-(args.context + args.steps + 32) // 16) + 8)
    rng = random.Random(0)
    for i in range(batch):
        llm.engine.add_request({"prompt_token_ids": [rng.randrange(10, 1000)
                                                     for _ in range(args.context)]},
                               SamplingParams(max_tokens=10_000, ignore_eos=True,
                                              temperature=0.0), request_id=str(i))
    sched = llm.engine.scheduler
    while sched.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                   for r in sched.running):
        llm.engine.step()
    llm.engine.step()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - t)
    cfg = llm.engine.config.model
    hw = HARDWARE_PRESETS[args.hardware]
    kv = batch * (args.context + args.steps // 2) * cfg.kv_bytes_per_token
    floor = (weight_bytes(llm.engine.runner.model) + kv) / (hw.memory_bandwidth_gbps * 1e9)
    step = statistics.median(times)
    del llm
    torch.cuda.empty_cache()
    return {"batch": batch, "step_ms": step * 1e3, "roofline_ms": floor * 1e3,
            "ratio": step / floor}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--hardware", default="h200", choices=sorted(HARDWARE_PRESETS))
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--attention-backend", default="auto")
    args = p.parse_args()
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
    print(f"{args.model} {args.dtype} on {name}, attention {args.attention_backend}, "
          f"context {args.context}, roofline at "
          f"{HARDWARE_PRESETS[args.hardware].memory_bandwidth_gbps:,.0f} GB/s")
    for b in (int(x) for x in args.batches.split(",")):
        r = measure(args, b)
        print(f"batch {r['batch']:4d}: decode step {r['step_ms']:8.2f} ms   roofline "
              f"{r['roofline_ms']:7.2f} ms   ratio {r['ratio']:6.2f}")


if __name__ == "__main__":
    main()
