"""Causal prefill attention of a fresh prompt: torch's SDPA against conveyor's kernel
(``kernels/prefill_attention.c``) built for each instruction set this CPU runs (its own,
AVX-512 without BF16, capped at AVX2, portable C), in float32 and bfloat16, side by side
in rounds, on SmolLM2-135M's heads (9 query, 3 KV, dim 64). In bf16 the kernel also runs the way it
did before it read bf16 itself (on fp32 copies, rounded once after), for comparison.
Each row also says how many of its outputs are bit-equal to SDPA's in the same dtype
(torch's CPU flash attention; in bf16 it rounds the softmax numerators for P @ V, as the
AVX-512 BF16 body does).

    python -m benchmarks.kernels.prefill_attention --tokens 64,146,256 --threads 2

``--against REV`` adds a row for git revision REV's kernel (built with this tree's flags
for this CPU, in the same rounds): a kernel change's before and after in one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from conveyor.kernels import cpu as kernels
from conveyor.kernels.cpu.cpuinfo import cpu_model_name
from conveyor.model.attention.native_prefill import NativePrefill


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="64,146,256", help="prompt lengths (the peers "
                   "workload's prompts are uniform 32-256)")
    p.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--against", metavar="REV", help="also time git revision REV's kernel")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    scale = d ** -0.5
    libs = {isa: kernels.load_variant(isa) for isa in kernels.isa_builds()
            if isa != "amx-emulated"}  # (scalar tiles: for tests, not timings)
    libs = {isa: lib for isa, lib in libs.items() if lib is not None}
    if not libs:
        raise SystemExit(f"native kernels unavailable: {kernels.why_unavailable()}")
    if args.against:
        import tempfile

        from benchmarks.common import build_at

        libs[f"@ {args.against}"] = build_at(
            args.against, "prefill_attention.c", tempfile.mkdtemp(), "prefill_attention_amx.c")
    print(f"CPU: {cpu_model_name()}, {args.threads} threads, heads {hq}/{hkv} x {d}; "
          f"kernel builds: {', '.join(libs)}")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for t in (int(x) for x in args.tokens.split(",")):
            qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
            q = qkv[:, :hq * d].view(t, hq, d)
            k = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)
            v = qkv[:, (hq + hkv) * d:].view(t, hkv, d)

            def sdpa(q=q, k=k, v=v) -> torch.Tensor:
                o = F.scaled_dot_product_attention(
                    q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                    v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
                    enable_gqa=True)
                return o[0].transpose(0, 1)

            fns = {f"sdpa ({dtype_name})": sdpa}
            for isa, lib in libs.items():
                kernel = NativePrefill(lib)

                def native(kernel=kernel, q=q, k=k, v=v) -> torch.Tensor:
                    out = torch.empty(q.shape, dtype=q.dtype)
                    assert kernel(q, k, v, out, scale)
                    return out

                fns[f"native {isa}"] = native
                if dtype is torch.bfloat16:
                    def copies(kernel=kernel, q=q, k=k, v=v) -> torch.Tensor:
                        out32 = torch.empty(q.shape, dtype=torch.float32)
                        assert kernel(q.float(), k.float(), v.float(), out32, scale)
                        return out32.to(torch.bfloat16)

                    fns[f"native {isa}, fp32 copies"] = copies
            times: dict[str, list[float]] = {name: [] for name in fns}
            reps = max(5, 20_000 // t)
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    fn()
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        fn()
                    times[name].append((time.perf_counter() - t0) / reps)
            base = statistics.median(times[f"sdpa ({dtype_name})"])
            want = sdpa()
            print(f"\n{dtype_name}, {t} tokens:")
            for name, ts in times.items():
                m = statistics.median(ts)
                same = (fns[name]() == want).float().mean().item()
                print(f"  {name:30s} {m * 1e6:8.1f} us per segment   {base / m:5.2f}x SDPA"
                      f"   {100 * same:5.1f}% bit-equal to SDPA")


if __name__ == "__main__":
    main()
