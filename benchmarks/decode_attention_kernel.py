"""The native decode-attention kernel alone: time per step (all layers) and bytes/s.

Batch B sequences of ``--context`` tokens, SmolLM2-135M's heads (9 query, 3 KV, dim 64)
by default, their KV blocks scattered at random over a cache of ``--layers`` layers'
worth of blocks (as a paged cache ends up after a while, and too big for the caches),
one kernel call per layer. Checks the output against a dense softmax first.

    python benchmarks/decode_attention_kernel.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from conveyor.model import kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=260)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lib = kernels.load()
    if lib is None:
        raise SystemExit("the native kernels could not be built (no C compiler?)")
    b, hq, hkv, d, ctx, bs = (args.batch, args.heads, args.kv_heads, args.head_dim,
                              args.context, args.block_size)
    per_seq = -(-ctx // bs)
    num_blocks = b * per_seq * args.layers
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(num_blocks * bs, hkv, d, generator=gen)
    v_cache = torch.randn(num_blocks * bs, hkv, d, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).view(args.layers, b, per_seq)
    offsets = torch.arange(bs)
    slots = [(order[i, :, :, None] * bs + offsets).view(b, -1)[:, :ctx].contiguous()
             for i in range(args.layers)]
    q = torch.randn(b, hq, d, generator=gen)
    lens = torch.full((b,), ctx, dtype=torch.int32)
    starts = torch.zeros(b, dtype=torch.int32)
    out = torch.empty(b, hq, d)
    scale = d ** -0.5

    def call(layer: int) -> None:
        s = slots[layer]
        lib.decode_attention_f32(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                 s.data_ptr(), lens.data_ptr(), starts.data_ptr(),
                                 out.data_ptr(), b, hq, hkv, d, s.shape[1], scale)

    call(0)
    k = k_cache[slots[0]].repeat_interleave(hq // hkv, dim=2).permute(0, 2, 1, 3)
    v = v_cache[slots[0]].repeat_interleave(hq // hkv, dim=2).permute(0, 2, 1, 3)
    ref = torch.softmax(q[:, :, None] @ k.transpose(-1, -2) * scale, -1) @ v
    err = (ref[:, :, 0] - out).abs().max().item()
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        for layer in range(args.layers):
            call(layer)
        times.append(time.perf_counter() - t)
    step = statistics.median(times)
    kv_bytes = args.layers * b * ctx * hkv * d * 4 * 2
    print(f"batch {b}, context {ctx}, heads {hq}/{hkv}x{d}, {args.layers} layers, "
          f"{args.threads} threads: {step * 1e3:.1f} ms a step "
          f"({step * 1e3 / args.layers:.2f} ms a layer), K+V read at "
          f"{kv_bytes / step / 1e9:.1f} GB/s; max abs error vs dense {err:.1e}")


if __name__ == "__main__":
    main()
