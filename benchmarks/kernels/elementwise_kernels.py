"""The fused elementwise kernels alone (``kernels/elementwise.c``): RMSNorm, residual add +
RMSNorm, SiLU-and-mul and RoPE on a decode batch and a 2,048-token prefill step of
SmolLM2-135M's shape (hidden 576, intermediate 1,536, 9 query and 3 KV heads of 64), in
float32 and bfloat16: microseconds a call and the bytes a call moves per second. With
``--against REV`` the same kernels of git revision REV (built with this tree's flags)
are timed in alternation in the same run, and each row says how many output elements
are bit-equal to that build's.

    python -m benchmarks.kernels.elementwise_kernels --threads 2
    python -m benchmarks.kernels.elementwise_kernels --threads 2 --against HEAD~1
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from benchmarks.common import build_at
from conveyor.kernels import cpu as kernels
from conveyor.kernels.cpu.cpuinfo import cpu_model_name


def cases(dtype: torch.dtype, rows: int, hidden: int, inter: int, heads: int,
          kv_heads: int, head_dim: int):
    """Per op: (call(lib) -> its output tensor or tensors, restore() of the inputs it
    changes in place, the bytes a call reads and writes)."""
    g = torch.Generator().manual_seed(0)
    sfx = "f32" if dtype is torch.float32 else "bf16"
    size = torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    res0 = torch.randn(rows, hidden, generator=g).to(dtype)
    res = res0.clone()
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    gate_up = (2 * torch.randn(rows, 2 * inter, generator=g)).to(dtype)
    row = (heads + 2 * kv_heads) * head_dim
    qkv0 = torch.randn(rows, row, generator=g).to(dtype)
    qkv = qkv0.clone()
    positions = torch.randint(0, 4096, (rows,), generator=g)
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(4096).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().contiguous(), emb.sin().contiguous()
    out_h = torch.empty(rows, hidden, dtype=dtype)
    out_i = torch.empty(rows, inter, dtype=dtype)

    def rms(lib):
        getattr(lib, f"rms_norm_{sfx}")(x.data_ptr(), w.data_ptr(), out_h.data_ptr(), rows,
                                        hidden, 1e-5)
        return out_h

    def add_rms(lib):
        getattr(lib, f"add_rms_norm_{sfx}")(x.data_ptr(), res.data_ptr(), w.data_ptr(),
                                            out_h.data_ptr(), rows, hidden, 1e-5)
        return out_h, res

    def silu(lib):
        getattr(lib, f"silu_mul_{sfx}")(gate_up.data_ptr(), out_i.data_ptr(), rows, inter)
        return out_i

    def rope(lib):
        getattr(lib, f"rope_{sfx}")(qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(),
                                    sin.data_ptr(), rows, heads + kv_heads, row, head_dim)
        return qkv

    rotated = rows * (heads + kv_heads) * head_dim
    def none() -> None:
        pass

    return {"rms_norm": (rms, none, 2 * rows * hidden * size),
            "add_rms_norm": (add_rms, lambda: res.copy_(res0), 4 * rows * hidden * size),
            "silu_mul": (silu, none, 3 * rows * inter * size),
            "rope": (rope, lambda: qkv.copy_(qkv0), 2 * rotated * size)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="32,2048", help="token rows a call (decode, prefill)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--calls", type=int, default=30, help="calls a timing (a model's layers)")
    p.add_argument("--against", metavar="REV", help="also time the kernels of this revision")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    lib = kernels.load()
    if lib is None:
        raise SystemExit(f"native kernels unavailable {kernels.why_unavailable()}")
    libs = {"this tree": lib}
    if args.against:
        libs[f"at {args.against}"] = build_at(args.against, "elementwise.c", tempfile.mkdtemp())
    print(f"CPU: {cpu_model_name()}, {args.threads} threads, isa build {kernels.kernel_isa()}; "
          f"median of {args.repeats} timings of {args.calls} calls")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for rows in (int(r) for r in args.rows.split(",")):
            for op, (fn, restore, nbytes) in cases(dtype, rows, 576, 1536, 9, 3, 64).items():
                outs = {}
                for label, lb in libs.items():  # the same inputs for each build
                    restore()
                    got = fn(lb)
                    outs[label] = torch.cat([t.flatten() for t in (
                        got if isinstance(got, tuple) else (got,))])
                times: dict[str, list[float]] = {label: [] for label in libs}
                for _ in range(args.repeats):
                    for label, lb in libs.items():  # in alternation: drift hits all alike
                        t = time.perf_counter()
                        for _ in range(args.calls):
                            fn(lb)
                        times[label].append((time.perf_counter() - t) / args.calls)
                base = statistics.median(times["this tree"])
                for label in libs:
                    s = statistics.median(times[label])
                    same = (outs[label] == outs["this tree"]).float().mean().item()
                    print(f"  {name:8s} {rows:5d} rows {op:13s} {label:14s} {s * 1e6:9.1f} us "
                          f"{nbytes / s / 1e9:6.1f} GB/s  {s / base:5.2f}x this tree's time, "
                          f"{100 * same:6.2f}% bit-equal to this tree")


if __name__ == "__main__":
    main()
