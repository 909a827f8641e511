"""The native decode-attention kernel alone: time per step (all layers) and bytes/s.

Batch B sequences of ``--context`` tokens, SmolLM2-135M's heads (9 query, 3 KV, dim 64)
by default, their KV blocks scattered at random over a cache of ``--layers`` layers'
worth of blocks (as a paged cache ends up after a while, and too big for the caches),
one kernel call per layer. Each row is one body on one cache dtype: the entry the engine
calls (the vector body where the head dim is a multiple of the build's vector width) and
the generic body it replaced, timed in alternation in one run; each is checked against a
dense softmax first. The cache is on huge pages where the OS takes the advice, as the
engine's pool is; then a last row times the entry on a copy on small pages. With
``--against REV`` the entry of git revision REV's ``decode_attention.c`` (built with this
tree's flags) is timed in the same alternation: a kernel change's before and after in one
run, which the VM's drift hits alike.

    python -m benchmarks.kernels.decode_attention_kernel --threads 2
    python -m benchmarks.kernels.decode_attention_kernel --threads 2 --against HEAD~1 --layers 1
    python -m benchmarks.kernels.decode_attention_kernel --dtypes bfloat16 --head-dim 128 \
        --kv-heads 8 --heads 32
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time

import torch

from benchmarks.common import build_at
from conveyor.kernels import cpu as kernels
from conveyor.kernels.cpu.cpuinfo import cpu_model_name
from conveyor.runner import huge_pages


def _on_other_cache(fn, k_ptr: int, v_ptr: int, q_ptr: int, _k: int, _v: int, *rest):
    return fn(q_ptr, k_ptr, v_ptr, *rest)


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
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--against", metavar="REV", help="also time the entry of this git revision")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lib = kernels.load()
    if lib is None:
        raise SystemExit("the native kernels could not be built (no C compiler?)")
    other = (build_at(args.against, "decode_attention.c", tempfile.mkdtemp())
             if args.against else None)
    b, hq, hkv, d, ctx, bs = (args.batch, args.heads, args.kv_heads, args.head_dim,
                              args.context, args.block_size)
    per_seq = -(-ctx // bs)
    num_blocks = b * per_seq * args.layers
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(num_blocks, generator=gen).view(args.layers, b, per_seq)
    offsets = torch.arange(bs)
    slots = [(order[i, :, :, None] * bs + offsets).view(b, -1)[:, :ctx].contiguous()
             for i in range(args.layers)]
    q32 = torch.randn(b, hq, d, generator=gen)
    lens = torch.full((b,), ctx, dtype=torch.int32)
    starts = torch.zeros(b, dtype=torch.int32)
    out = torch.empty(b, hq, d)
    scale = d ** -0.5
    print(f"{cpu_model_name()}, {args.threads} threads, isa build {kernels.kernel_isa()}; "
          f"batch {b}, context {ctx}, heads {hq}/{hkv}x{d}, {args.layers} layers")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        # The pool as the engine allocates it (runner/huge_pages.py), and a copy on the
        # small pages torch gives by default.
        k_small = torch.randn(num_blocks * bs, hkv, d, generator=gen).to(dtype)
        v_small = torch.randn(num_blocks * bs, hkv, d, generator=gen).to(dtype)
        pool, advised = huge_pages.zeros((2, *k_small.shape), dtype)
        pool[0].copy_(k_small)
        pool[1].copy_(v_small)
        k_cache, v_cache = pool[0], pool[1]
        suffix = "f32" if dtype is torch.float32 else "bf16"
        q = q32.to(dtype).float()  # a bf16 model's q holds bf16 values (the kernel checks)
        entry = getattr(lib, f"decode_attention_{suffix}")
        bodies = {"entry (vector body)": entry,
                  "generic body": getattr(lib, f"decode_attention_{suffix}_generic")}
        if other is not None:
            bodies[f"entry at {args.against}"] = getattr(other, f"decode_attention_{suffix}")
        if advised:
            bodies["entry, small pages"] = functools.partial(
                _on_other_cache, entry, k_small.data_ptr(), v_small.data_ptr())

        def call(fn, layer: int, k_cache=k_cache, v_cache=v_cache, q=q) -> None:
            s = slots[layer]
            fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), s.data_ptr(),
               lens.data_ptr(), starts.data_ptr(), out.data_ptr(), b, hq, hkv, d,
               s.shape[1], scale)

        k = k_cache[slots[0]].float().repeat_interleave(hq // hkv, dim=2).permute(0, 2, 1, 3)
        v = v_cache[slots[0]].float().repeat_interleave(hq // hkv, dim=2).permute(0, 2, 1, 3)
        ref = (torch.softmax(q[:, :, None] @ k.transpose(-1, -2) * scale, -1) @ v)[:, :, 0]
        errs = {}
        for label, fn in bodies.items():
            call(fn, 0)
            errs[label] = (ref - out).abs().max().item()
        times: dict[str, list[float]] = {label: [] for label in bodies}
        for _ in range(args.repeats):
            for label, fn in bodies.items():  # (alternated: the VM's drift hits both)
                t = time.perf_counter()
                for layer in range(args.layers):
                    call(fn, layer)
                times[label].append(time.perf_counter() - t)
        kv_bytes = args.layers * b * ctx * hkv * d * k_cache.element_size() * 2
        base = statistics.median(times["generic body"])
        for label in bodies:
            step = statistics.median(times[label])
            print(f"  {name:8s} {label:20s} {step * 1e3:7.2f} ms a step "
                  f"({step * 1e3 / args.layers:.3f} ms a layer), K+V read at "
                  f"{kv_bytes / step / 1e9:5.1f} GB/s, {base / step:.2f}x the generic body; "
                  f"max abs error vs dense {errs[label]:.1e}")


if __name__ == "__main__":
    main()
