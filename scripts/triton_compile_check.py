#!/usr/bin/env python3
"""Compiles every Triton kernel of conveyor for real GPU targets, no GPU needed.

    python scripts/triton_compile_check.py --arch sm_80,sm_90

For each target and each configuration the backend launches (dtypes, head sizes, GQA
groups), ``triton.compile`` builds the cubin (ptxas included) for
``GPUTarget("cuda", arch, 32)``; a compile error, or shared memory over the target's
limit, fails the run (exit 1). Prints one line per build.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# The interpreter wraps kernels instead of compiling them: this check needs it off.
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # 3.9's default, without its warning

# Largest shared memory a block may use (opt-in), in bytes.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}

_PTR = {"float16": "*fp16", "bfloat16": "*bf16", "float32": "*fp32"}


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def builds() -> list[tuple[str, str, dict, dict]]:
    """(kernel, label, signature, constexprs) of every configuration checked: the
    model shapes the GPU check runs (llama3-8b: 32/8 heads of 128; qwen3-0.6b: 16/8 of
    128) and the tests' (head 16-64, groups 1-8), in each dtype."""
    out = []
    for dtype, ptr in _PTR.items():
        for d in (64, 128):
            bd = max(16, _pow2(d))
            sig = {n: ptr for n in ("K", "V", "K_CACHE", "V_CACHE")}
            sig |= {"SLOTS": "*i64"} | {n: "i32" for n in (
                "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_cs", "stride_ch",
                "stride_vcs", "stride_vch")}
            sig |= {"HEAD_DIM": "constexpr", "BLOCK_D": "constexpr"}
            out.append(("write_kv", f"{dtype} D={d}", sig, {"HEAD_DIM": d, "BLOCK_D": bd}))
            for group in (1, 2, 4, 8):
                gp = _pow2(group)
                bq = max(1, 16 // gp)
                sig = {n: ptr for n in ("Q", "K_CACHE", "V_CACHE", "OUT")}
                sig |= {"SLOT_TABLE": "*i64"} | {n: "*i32" for n in (
                    "Q_START", "Q_LEN", "CTX_LEN", "KV_LO")}
                sig |= {"scale": "fp32", "softcap": "fp32", "window": "i32"}
                sig |= {n: "i32" for n in (
                    "stride_qt", "stride_qh", "stride_kcs", "stride_kch", "stride_vcs",
                    "stride_vch", "stride_ot", "stride_oh", "stride_st")}
                const = {"HEAD_DIM": d, "BLOCK_D": bd, "GROUP": group, "GROUP_P": gp,
                         "BLOCK_Q": bq, "BLOCK_N": 64, "IEEE": dtype == "float32"}
                sig |= {n: "constexpr" for n in const}
                out.append(("unified_attention", f"{dtype} D={d} group={group}", sig, const))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_80,sm_90",
                        help="comma-separated CUDA targets (sm_80, sm_90, ...)")
    parser.add_argument("--quick", action="store_true",
                        help="one configuration per kernel and dtype (CI)")
    args = parser.parse_args(argv)
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError:
        print("triton is not installed (pip install 'conveyor[triton]')", file=sys.stderr)
        return 2
    from conveyor.model.attention.triton_kernels import KERNELS

    jitted = {name: triton.jit(fn) for name, fn in KERNELS.items()}
    todo = builds()
    if args.quick:
        todo = [b for b in todo if "D=128" in b[1] and "group=1" not in b[1]
                and "group=2" not in b[1] and "group=8" not in b[1]]
    failures = 0
    for arch in args.arch.split(","):
        cc = int(arch.strip().removeprefix("sm_"))
        target = GPUTarget("cuda", cc, 32)
        for kernel, label, sig, const in todo:
            t0 = time.perf_counter()
            try:
                compiled = triton.compile(ASTSource(jitted[kernel], sig, const), target=target)
            except Exception as exc:  # every compile error is a failure, reported
                failures += 1
                print(f"FAIL sm_{cc} {kernel} [{label}]: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0] if str(exc) else ''}")
                continue
            shared = compiled.metadata.shared
            limit = SHARED_LIMIT.get(cc)
            over = limit is not None and shared > limit
            failures += over
            print(f"{'FAIL' if over else 'ok  '} sm_{cc} {kernel} [{label}]: "
                  f"{len(compiled.asm['cubin'])} B cubin, {shared} B shared"
                  f"{f' > {limit}' if over else ''}, {time.perf_counter() - t0:.1f} s")
    print(f"{len(todo) * len(args.arch.split(','))} builds, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
