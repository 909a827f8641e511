"""Every figure the CPU performance issue asks of a machine, in one run: what a session
that lands on a CPU kind not measured before (an Intel Xeon with AMX, say) runs first.

It prints the CPU (model, family, the flags that pick kernels) and then runs, one after
another, each writing its own output to ``<out>/<name>.txt`` as well as the terminal:

- ``pytest`` of the kernel tests (every body this CPU builds, the AMX one included where
  the CPU has AMX);
- ``kernels/prefill_attention.py`` (bf16 and fp32: SDPA against each kernel body);
- ``steps/prefill_step.py`` in both dtypes (a 2,048-token step against its GEMM floor: on AMX
  the issue's target is bf16 within 1.5x);
- ``steps/decode_step.py`` in both dtypes at batch 32 (the step against the floor of every
  linear backend, and where the rest goes);
- ``peers/run.py --peers conveyor,vllm --interleave`` (both dtypes), unless
  ``--no-peers`` (it installs vLLM's CPU wheel on first use: minutes).

    python -m benchmarks.cpu_report                # ~11 minutes on 2 cores
    python -m benchmarks.cpu_report --no-peers     # ~4 minutes

Each benchmark runs as a module (``python -m benchmarks...``) from the repository root.
A step that fails is reported and the rest still run; the exit status says whether all
passed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile",
                "amx_bf16", "asimd", "sve", "bf16")


def describe_cpu() -> str:
    from conveyor.kernels.cpu.cpuinfo import cpu_flags, cpu_model_name, cpuinfo_field

    flags = cpu_flags()
    if flags is None:
        return f"CPU: {cpu_model_name()} (no /proc/cpuinfo)"
    have = [f for f in KERNEL_FLAGS if f in flags]
    return (f"CPU: {cpu_model_name()}, family {cpuinfo_field('cpu family') or '?'} model "
            f"{cpuinfo_field('model') or '?'}; {os.cpu_count()} CPUs; kernel flags: "
            f"{', '.join(have) or 'none'}")


def steps(peers: bool) -> list[tuple[str, list[str]]]:
    py = sys.executable
    out = [
        ("kernel-tests", [py, "-m", "pytest", "-q", "tests/test_prefill_attention.py",
                          "tests/test_decode_attention.py", "tests/test_elementwise_builds.py",
                          "tests/test_packed_linear.py", "tests/test_kernel_cross_builds.py"]),
        ("prefill-attention", [py, "-m", "benchmarks.kernels.prefill_attention",
                               "--tokens", "32,146,256,1024"]),
    ]
    for dtype in ("bfloat16", "float32"):
        out.append((f"prefill-step-{dtype}", [py, "-m", "benchmarks.steps.prefill_step",
                                               "--dtype", dtype, "--rounds", "5"]))
    for dtype in ("bfloat16", "float32"):
        out.append((f"decode-step-{dtype}", [py, "-m", "benchmarks.steps.decode_step",
                                              "--dtype", dtype, "--batch", "32"]))
    if peers:
        out.append(("peers", [py, "-m", "benchmarks.peers.run", "--peers", "conveyor,vllm",
                              "--interleave"]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-peers", action="store_true", help="skip the vLLM comparison")
    p.add_argument("--out", default=os.path.join(
        os.path.expanduser("~"), ".cache", "conveyor", "cpu_report",
        time.strftime("%Y%m%d-%H%M%S")))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    header = describe_cpu()
    print(header, flush=True)
    with open(os.path.join(args.out, "cpu.txt"), "w") as f:
        f.write(header + "\n")
    failed = []
    for name, cmd in steps(not args.no_peers):
        print(f"\n== {name}: {' '.join(cmd[1:])}", flush=True)
        start = time.perf_counter()
        with open(os.path.join(args.out, f"{name}.txt"), "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            rc = proc.wait()
        print(f"== {name}: exit {rc} after {time.perf_counter() - start:.0f} s", flush=True)
        if rc != 0:
            failed.append(name)
    print(f"\n{header}\noutputs: {args.out}" + (f"\nfailed: {', '.join(failed)}" if failed
                                                 else "\nall steps passed"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
