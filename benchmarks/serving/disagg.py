"""Prefill/decode disaggregation on this machine, at equal hardware: one engine with 2
threads (colocated) against a prefill engine with 1 thread and a decode engine with 1
thread behind ``conveyor router --prefill --decode`` (disaggregated), on a workload where
long prompts arrive while many requests decode (the Azure conversation trace, prompts and
outputs scaled). Measure, do not assert. Each configuration gets fresh servers; the load
is ``conveyor bench --backend openai`` (streamed, so ITL is measured per token).

    PYTHONPATH=src python -m benchmarks.serving.disagg --quick   # a few minutes: a smoke run
    PYTHONPATH=src python -m benchmarks.serving.disagg           # the figures (quiet machine)

Prints TTFT p50/p99, ITL p50/p99 (ms), output tokens/s and completed requests per
configuration, labelled with the CPU model, plus the KV bytes the decode engine pulled.
The GPU-scale question (which xPyD split maximises goodput) is
``benchmarks/sim/disagg_sim.py``. A trace that is not there is skipped (exit 0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator

from benchmarks.common import SHARED_TRACES

DEFAULT_TRACE = os.path.join(SHARED_TRACES, "azure_conv_2023.csv")
CLI = [sys.executable, "-m", "conveyor.entrypoints.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(url: str, proc: subprocess.Popen, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"a server exited ({proc.returncode}): {' '.join(proc.args)}")
        with contextlib.suppress(OSError), \
                urllib.request.urlopen(url + "/health", timeout=1) as r:
            if r.status == 200:
                return
        time.sleep(0.5)
    raise SystemExit(f"{url} not up in {timeout_s} s")


@contextlib.contextmanager
def _servers(cmds: list[list[str]], urls: list[str]) -> Iterator[None]:
    procs = []
    try:
        for cmd, url in zip(cmds, urls):
            procs.append(subprocess.Popen(cmd))
            if url:
                _wait_up(url, procs[-1])
        yield
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(f"conveyor:{name} "):
                return float(line.split()[1])
    return 0.0


def _bench(url: str, args: argparse.Namespace, out: str) -> dict:
    cmd = [*CLI, "bench", "--backend", "openai", "--base-url", url,
           "--openai-model", args.model, "--workload", args.workload,
           "--num-requests", str(args.num_requests), "--sample", "head",
           "--request-rate", str(args.request_rate), "--burstiness", "1.0",
           "--input-scale", str(args.input_scale), "--output-scale", str(args.output_scale),
           "--max-input-len", str(args.max_input_len), "--seed", "0",
           "--no-progress", "--out", out]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)["runs"][0]["summary"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="a short run to see it works (about 3-5 minutes on 2 cores)")
    p.add_argument("--model", default="smollm2-135m",
                   help="a built-in shape with dummy weights, or a checkpoint folder")
    p.add_argument("--workload", default=DEFAULT_TRACE)
    p.add_argument("--num-requests", type=int, default=160)
    p.add_argument("--request-rate", type=float, default=1.5)
    p.add_argument("--input-scale", type=float, default=1.0)
    p.add_argument("--output-scale", type=float, default=1.0)
    p.add_argument("--max-input-len", type=int, default=1800)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--out-dir", default=tempfile.gettempdir())
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.request_rate = 30, 1.0
        args.input_scale, args.output_scale, args.max_input_len = 0.5, 0.5, 900
    if not os.path.exists(args.workload):
        print(f"skipped: no trace at {args.workload}")
        return 0
    from conveyor.kernels.cpu.cpuinfo import cpu_model_name

    load = ["--load-format", "dummy"] if not os.path.isdir(args.model) else []
    common = ["--model", args.model, *load, "--dtype", "float32", "--log-level", "warning",
              "--no-access-log", "--max-num-seqs", "32",
              "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    print(f"CPU: {cpu_model_name()}; model {args.model} (float32); workload "
          f"{os.path.basename(args.workload)}: {args.num_requests} requests at "
          f"{args.request_rate:g}/s (Poisson), input x{args.input_scale:g} (<= "
          f"{args.max_input_len}), output x{args.output_scale:g}", flush=True)
    results: dict[str, tuple[dict, str]] = {}

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with _servers([[*CLI, "serve", *common, "--num-threads", "2", "--port", str(port)]],
                  [url]):
        results["colocated (1 engine x 2 threads)"] = (
            _bench(url, args, os.path.join(args.out_dir, "disagg-colocated.json")), "")

    pp, dp, kp, rp = _free_port(), _free_port(), _free_port(), _free_port()
    pre, dec, prx = (f"http://127.0.0.1:{x}" for x in (pp, dp, rp))
    cmds = [[*CLI, "serve", *common, "--num-threads", "1", "--port", str(pp),
             "--kv-role", "prefill", "--kv-port", str(kp)],
            [*CLI, "serve", *common, "--num-threads", "1", "--port", str(dp),
             "--kv-role", "decode"],
            [*CLI, "router", "--prefill", pre, "--decode", dec, "--port", str(rp),
             "--log-level", "warning", "--no-access-log"]]
    with _servers(cmds, [pre, dec, prx]):
        summary = _bench(prx, args, os.path.join(args.out_dir, "disagg-disaggregated.json"))
        moved = _metric(dec, "kv_transfer_bytes_received_total")
        computed = _metric(dec, "prompt_tokens_computed_total")
        failed = _metric(dec, "kv_transfer_failed_total")
        note = (f"KV pulled {moved / 2**20:.1f} MiB, decode engine computed {computed:.0f} "
                f"prompt tokens, {failed:.0f} failed loads")
        results["disaggregated (1P x 1 thread + 1D x 1 thread)"] = (summary, note)

    print(f"{'configuration':<48} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} "
          f"{'ITL p99':>8} {'out tok/s':>9} {'done':>6}")
    for label, (s, note) in results.items():
        lat = s["latency"]
        print(f"{label:<48} {lat['ttft']['median']:>9,.0f} {lat['ttft']['p99']:>9,.0f} "
              f"{lat['itl']['median']:>8,.1f} {lat['itl']['p99']:>8,.1f} "
              f"{s['output_throughput']:>9,.1f} {s['num_completed']:>3}/{s['num_requests']}")
        if note:
            print(f"  {note}")
    print("(latencies in ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
