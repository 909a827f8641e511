"""Causal prefill attention of a bf16 prompt: torch's SDPA (its CPU flash attention in
bf16) against conveyor's fp32 prefill kernel on fp32 copies (what ``NativePrefill`` does
for bf16), side by side in rounds, on SmolLM2-135M's heads (9 query, 3 KV, dim 64).

    python benchmarks/prefill_attention_bf16.py --tokens 146 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from conveyor.model import kernels
from conveyor.model.decode_attention import NativePrefill
from conveyor.model.linear_choice import cpu_model_name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=146, help="prompt length (the peers "
                   "workload's prompts are uniform 32-256)")
    p.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    t, scale = args.tokens, d ** -0.5
    lib = kernels.load()
    if lib is None:
        raise SystemExit(f"native kernels unavailable: {kernels.why_unavailable()}")
    prefill = NativePrefill(lib)
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(torch.bfloat16)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)

    def sdpa() -> torch.Tensor:
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)

    def native() -> torch.Tensor:
        out = torch.empty(q.shape, dtype=torch.bfloat16)
        assert prefill(q, k, v, out, scale)
        return out

    times: dict[str, list[float]] = {"sdpa (bf16)": [], "native (fp32 copies)": []}
    fns = dict(zip(times, (sdpa, native)))
    for _ in range(args.rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(50):
                fn()
            times[name].append((time.perf_counter() - t0) / 50)
    print(f"CPU: {cpu_model_name()}, {args.threads} threads, {t} tokens, heads {hq}/{hkv} "
          f"x {d}")
    base = statistics.median(times["sdpa (bf16)"])
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:22s} {m * 1e6:8.1f} us per segment   {base / m:5.2f}x SDPA")


if __name__ == "__main__":
    main()
