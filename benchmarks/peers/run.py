"""Peers, side by side on this machine: conveyor, vLLM (CPU), HF generate, transformers
serve and llama.cpp on the same checkpoint, the same workload file and the same client.

    python -m benchmarks.peers.run  # the full table (bf16 and fp32)
    python -m benchmarks.peers.run --setup  # only install the peers, then exit
    python -m benchmarks.peers.run --smoke  # 4 short requests, 1 run: a pipeline check
    python -m benchmarks.peers.run --peers conveyor,vllm --dtypes bf16 --runs 1
    python -m benchmarks.peers.run --peers conveyor,vllm --trace AZURE_CSV  # the trace sample
    python -m benchmarks.peers.run --peers conveyor,llamacpp,vllm --dtypes q8_0,q4_0 --batch 1
    python -m benchmarks.peers.run --peers conveyor,llamacpp,vllm --dtypes q8_0,q4_0 --batch 32

Every server is started once per dtype on a free loopback port, waited for, warmed up
with a few short requests, driven --runs times by `conveyor bench --backend openai`
(all requests at t=0, token-id prompts, ignore_eos), and stopped, even on error; one
engine at a time. The table shows the median of the runs and each peer's ratio to
conveyor. Peers live in their own venvs under ~/.cache/conveyor/peers (or
$CONVEYOR_CACHE/peers); the first run installs them (vLLM's wheel, transformers,
a llama.cpp build), later runs skip what is there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from datetime import datetime

from benchmarks.common import REPO
from benchmarks.peers import install
from benchmarks.peers.checkpoint import ensure_checkpoint, ensure_gguf
from benchmarks.peers.checks import record_mismatches, text_prompt_failures
from benchmarks.peers.quantized import (
    QUANT_DTYPES,
    ensure_quantized_gguf,
    ensure_w8a8_checkpoint,
    unsupported,
)
from benchmarks.peers.servers import Server, ServerError, tail
from benchmarks.peers.shapes import SHAPE_NAMES
from benchmarks.peers.systems import GGUF_TYPE, SERVED_NAME, SYSTEMS, Context, System
from benchmarks.peers.table import RunFigures, SystemResult, format_table
from benchmarks.peers.workload_file import (
    TraceSpec,
    WorkloadSpec,
    bench_workload_argv,
    load_requests,
    write_requests_json,
    write_workload,
)

HERE = os.path.dirname(os.path.abspath(__file__))

# The figures on this machine (tokens/s bf16, fp32; startup s), for the wall-time
# estimate only; conveyor's own is a guess.
REFERENCE = {"conveyor": (200, 120, 20), "vllm": (391, 197, 90), "hf-generate": (131, 75, 10),
             "transformers-serve": (121, 78, 20), "llamacpp": (91, 89, 5)}


# Conveyor fp32 completes the default trace sample (64 Azure conversation requests, token
# counts x0.25) at ~TRACE_CAPACITY req/s when all arrive at once on this 2-core machine;
# the default arrival rate oversubscribes it 4x.
TRACE_CAPACITY = 1.2
TRACE_RATE = 4 * TRACE_CAPACITY


class BenchError(RuntimeError):
    pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--peers", type=_csv(SYSTEMS), default=list(SYSTEMS),
                   help=f"systems to run, in order (default: {','.join(SYSTEMS)})")
    p.add_argument("--dtypes", type=_csv(("bf16", "fp32", *QUANT_DTYPES)),
                   default=["bf16", "fp32"],
                   help="bf16, fp32, and the quantized q8_0, q4_0 (quantized.py: conveyor "
                        "--quantization int8/int4, llama.cpp GGUF Q8_0/Q4_0, vLLM W8A8)")
    p.add_argument("--model-shapes", type=_csv(SHAPE_NAMES), default=["smollm2"],
                   help="checkpoints to run on, one after another (benchmarks/peers/"
                        "shapes.py: smollm2 (Llama), gemma2, qwen3-moe, mixtral; random "
                        "weights, the shared tokenizer)")
    p.add_argument("--runs", type=int, default=3, help="measured runs per system and dtype "
                                                      "(the table shows their median)")
    p.add_argument("--setup", action="store_true",
                   help="install the selected peers (skipping what is there) and exit")
    p.add_argument("--smoke", action="store_true",
                   help="pipeline check: 4 requests, outputs 8-16 tokens, 1 run")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help="a decode workload at batch N: N requests at t=0, prompts of 128 "
                        "tokens, outputs of 256 (--prompt-len / --output-len override)")
    p.add_argument("--prompt-len", default=None, help="uniform LO-HI (default 32-256)")
    p.add_argument("--output-len", default=None, help="uniform LO-HI (default 16-256)")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="replay a trace sample at its arrival times instead of the 32 "
                        "requests at t=0 (Azure CSV or Mooncake JSONL)")
    p.add_argument("--trace-requests", type=int, default=64, help="the trace's first N rows")
    p.add_argument("--trace-scale", type=float, default=0.25,
                   help="multiply the trace's token counts (a CPU-sized sample)")
    p.add_argument("--trace-max-input", type=int, default=1024, help="cap on prompt tokens")
    p.add_argument("--trace-rate", type=float, default=TRACE_RATE,
                   help="arrival rate, requests/s (default: 4x what conveyor fp32 sustains on "
                        "the default sample: see the README)")
    p.add_argument("--seed", type=int, default=1234,
                   help="workload seed (1234: the issue's 4,138 output tokens)")
    p.add_argument("--checkpoint-seed", type=int, default=0, help="random weights' seed")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                   help="threads per engine (default: all cores)")
    p.add_argument("--interleave", action="store_true",
                   help="start every server of a dtype at once and take their runs in turns "
                        "(A, B, A, B, ...), so a drift in the machine's speed lands on all "
                        "of them alike (servers only; in-process peers are refused)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="4 short requests before the measured runs of each server")
    p.add_argument("--conveyor-args", default=None,
                   help="replace conveyor serve's engine options (default: "
                        "'--max-num-seqs 128 --max-num-batched-tokens 2048 "
                        "--no-enable-prefix-caching')")
    p.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds a server may take to become ready")
    p.add_argument("--cache-dir", default=install.default_root(),
                   help="peers' venvs, builds, checkpoints and runs (default: %(default)s)")
    p.add_argument("--out-dir", default=None,
                   help="this run's files (default: CACHE/runs/<timestamp>)")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error("--runs must be >= 1")
    if args.interleave and any(SYSTEMS[n].server is None
                               or "text" in SYSTEMS[n].bench_args for n in args.peers):
        p.error("--interleave takes servers fed token ids only (conveyor, vllm)")
    if args.batch is not None:
        if args.batch < 1 or args.num_requests is not None or args.trace:
            p.error("--batch N (N >= 1) replaces --num-requests and --trace")
        args.num_requests = args.batch
        args.prompt_len = args.prompt_len or "128-128"
        args.output_len = args.output_len or "256-256"
    if args.smoke:
        args.num_requests = args.num_requests or 4
        args.output_len = args.output_len or "8-16"
        args.runs = 1
    return args


def _csv(valid):
    def parse(text: str) -> list[str]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if x not in valid]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {bad or text!r}; valid: "
                                             f"{', '.join(valid)}")
        return items
    return parse


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A SIGTERM unwinds like Ctrl-C, so the running server is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.perf_counter()
    paths = install.PeerPaths(args.cache_dir)
    install.setup([SYSTEMS[name].setup for name in args.peers if SYSTEMS[name].setup], paths)
    if args.setup:
        print(f"setup done in {time.perf_counter() - started:.0f}s")
        return 0

    if args.trace:
        spec = TraceSpec(args.trace, args.trace_requests, args.trace_scale,
                         args.trace_max_input, args.trace_rate, args.seed)
    else:
        spec = WorkloadSpec(args.num_requests or 32, args.prompt_len or "32-256",
                            args.output_len or "16-256", args.seed)
    out_dir = args.out_dir or os.path.join(paths.root, "runs",
                                           datetime.now().strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out_dir, exist_ok=True)
    workload = os.path.join(out_dir, "workload.jsonl")
    rows = write_workload(workload, spec)
    warmup = os.path.join(out_dir, "warmup.jsonl")
    write_workload(warmup, WorkloadSpec(4, "16-32", "4-8", args.seed + 1))
    prompt_tokens = sum(r.input_len for r in rows)
    output_tokens = sum(r.output_len for r in rows)
    print(f"workload:   {workload}: {spec.describe()}; {prompt_tokens:,} prompt tokens, "
          f"{output_tokens:,} output tokens")
    print(f"systems:    {', '.join(args.peers)}; shapes {', '.join(args.model_shapes)}; "
          f"dtypes {', '.join(args.dtypes)}; {args.runs} run(s) each (median), "
          f"{args.threads} threads per engine")
    print(f"estimated wall time: ~{estimate_s(args, output_tokens) / 60:.0f} min "
          f"(from the issue's figures, on the smollm2 shape)")
    print(f"files:      {out_dir}", flush=True)

    results: dict[str, list[SystemResult]] = {}
    checkpoints: dict[str, str] = {}
    for shape in args.model_shapes:
        checkpoint = ensure_checkpoint(paths.root, args.checkpoint_seed, shape)
        checkpoints[shape] = checkpoint
        # One shape's server logs and records in a folder of their own.
        shape_dir = out_dir if len(args.model_shapes) == 1 else os.path.join(out_dir, shape)
        os.makedirs(shape_dir, exist_ok=True)
        print(f"\n=== model shape {shape}: {checkpoint}")
        print(f"client:     conveyor bench --backend openai "
              f"{shlex.join(bench_workload_argv(workload, spec.seed, at_once(spec)))} "
              f"--openai-model {SERVED_NAME} --model {checkpoint}", flush=True)
        run_shape(args, paths, shape, checkpoint, spec, workload, warmup, rows, shape_dir,
                  results)

    wall = time.perf_counter() - started
    save(out_dir, results, args, spec, checkpoints, wall)
    print()
    for dtype, res in results.items():
        print(format_table(res, f"{dtype}, median of {args.runs} run(s)"))
        print()
    print(f"wall time: {wall / 60:.1f} min; results: {os.path.join(out_dir, 'table.md')}")
    return 0 if all(r.runs for res in results.values() for r in res) else 1


def run_shape(args: argparse.Namespace, paths: install.PeerPaths, shape: str, checkpoint: str,
              spec: WorkloadSpec | TraceSpec, workload: str, warmup: str, rows: list,
              out_dir: str, results: dict[str, list[SystemResult]]) -> None:
    """Every dtype of one model shape, into ``results`` under "<dtype>" (the default
    shape alone) or "<shape> <dtype>"."""
    prompt_tokens = sum(r.input_len for r in rows)
    output_tokens = sum(r.output_len for r in rows)
    gguf: dict[str, str] = {}
    vllm_checkpoints: dict[str, str] = {}
    prepared: dict[tuple[str, str], str] = {}  # (system, dtype) -> why it cannot run
    if "llamacpp" in args.peers:
        for dtype in args.dtypes:
            try:
                gguf[dtype] = (ensure_quantized_gguf(checkpoint, dtype, paths)
                               if dtype in QUANT_DTYPES else
                               ensure_gguf(checkpoint, GGUF_TYPE[dtype],
                                           paths.python("llamacpp"), paths.llama_src,
                                           paths.log("llamacpp", "convert")))
            except (RuntimeError, OSError) as e:
                prepared["llamacpp", dtype] = str(e).splitlines()[0]
    if "vllm" in args.peers and "q8_0" in args.dtypes:
        try:
            vllm_checkpoints["q8_0"] = ensure_w8a8_checkpoint(
                checkpoint, os.path.join(out_dir, "w8a8-checkpoint.log"))
        except (RuntimeError, OSError) as e:
            prepared["vllm", "q8_0"] = str(e).splitlines()[0]
    # llama.cpp's unified KV holds every request's prompt and output at once.
    llama_ctx = max(4096, math.ceil((prompt_tokens + output_tokens + 64 * len(rows)) / 1024)
                    * 1024)
    conveyor_args = tuple(shlex.split(args.conveyor_args)) if args.conveyor_args else None
    ctx = Context(paths, REPO, checkpoint, args.threads, gguf, llama_ctx,
                  vllm_checkpoints=vllm_checkpoints,
                  **({"conveyor_args": conveyor_args} if conveyor_args else {}),
                  startup_timeout_s=args.startup_timeout)
    for dtype in args.dtypes:
        label = dtype if args.model_shapes == ["smollm2"] else f"{shape} {dtype}"
        results[label] = []
        refused = {n: why for n in args.peers
                   if (why := unsupported(n, dtype) or prepared.get((n, dtype)))}
        if args.interleave:
            t = time.perf_counter()
            print(f"\n== {', '.join(args.peers)} {label}, runs in turns", flush=True)
            ran = run_interleaved([SYSTEMS[n] for n in args.peers if n not in refused], dtype,
                                  ctx, args, workload, warmup, spec, rows, out_dir)
            by_name = {r.system: r for r in ran}
            results[label] = [by_name.get(n) or SystemResult(n, dtype, error=refused[n])
                              for n in args.peers]
            for res in results[label]:
                print(f"   {res.system} {label}: {run_status(res)}", flush=True)
            print(f"   ({time.perf_counter() - t:.0f}s)")
            print()
            print(format_table(results[label], f"{label}: {spec.describe()}"), flush=True)
            continue
        for name in args.peers:
            system = SYSTEMS[name]
            t = time.perf_counter()
            print(f"\n== {name} {label}", flush=True)
            if name in refused:
                res = SystemResult(name, dtype, error=refused[name])
            elif system.server is None and not at_once(spec):
                res = SystemResult(name, dtype, error="an in-process static batch has no "
                                   "arrival times: trace workloads are for servers")
            elif system.server is None:
                res = run_hf_generate(system, dtype, ctx, args, workload, spec, out_dir)
            else:
                res = run_server(system, dtype, ctx, args, workload, warmup, spec, rows, out_dir)
            print(f"   {name} {label}: {run_status(res)} ({time.perf_counter() - t:.0f}s)",
                  flush=True)
            results[label].append(res)
        print()
        print(format_table(results[label], f"{label}: {spec.describe()}"), flush=True)


def run_status(res: SystemResult) -> str:
    """Why a system has no figures, or its runs' tokens/s."""
    return res.error or ", ".join(f"{r.tokens_per_s:.1f}" for r in res.runs) + " tokens/s"


def at_once(spec: WorkloadSpec | TraceSpec) -> bool:
    return not isinstance(spec, TraceSpec)


def estimate_s(args: argparse.Namespace, output_tokens: int) -> float:
    total = 0.0
    for name in args.peers:
        bf16, fp32, startup = REFERENCE[name]
        for dtype in args.dtypes:
            rate = bf16 if dtype == "bf16" else fp32
            total += startup + 5 + args.runs * output_tokens / rate
    return total


# ---- one system -------------------------------------------------------------------------------
def run_server(system: System, dtype: str, ctx: Context, args: argparse.Namespace,
               workload: str, warmup: str, spec: WorkloadSpec | TraceSpec, rows: list,
               out_dir: str
               ) -> SystemResult:
    from benchmarks.peers.servers import free_port

    res = SystemResult(system.name, dtype, note=system.note)
    if "text" in system.bench_args:
        # Text prompts must reach the server as the very token ids the others get.
        with open(os.path.join(ctx.checkpoint, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        prompts = [r.prompt_token_ids
                   for r in load_requests(workload, spec.seed, vocab, at_once(spec))]
        bad = text_prompt_failures(ctx.checkpoint, prompts)
        if bad:
            res.error = f"{len(bad)} prompt(s) do not survive decode + encode (e.g. #{bad[0]})"
            return res
        print(f"   text prompts: all {len(prompts)} re-tokenize to their token ids", flush=True)
    server_spec = system.server(ctx, dtype, free_port())
    log = os.path.join(out_dir, f"{system.name}-{dtype}.server.log")
    try:
        with Server(server_spec, log) as server:
            res.startup_s = server.startup_s
            print(f"   ready after {server.startup_s:.0f}s at {server_spec.base_url}",
                  flush=True)
            if args.warmup:
                bench(system, server_spec.base_url, ctx, warmup, spec.seed + 1, True,
                      os.path.join(out_dir, f"{system.name}-{dtype}-warmup.json"))
            for i in range(args.runs):
                measured_run(system, server_spec.base_url, ctx, workload, spec, rows, out_dir,
                             i, res)
    except (ServerError, BenchError, OSError) as e:
        res.error = str(e).splitlines()[0]
        print(f"   error: {e}", flush=True)
    return res


def run_interleaved(systems: list[System], dtype: str, ctx: Context, args: argparse.Namespace,
                    workload: str, warmup: str, spec: WorkloadSpec | TraceSpec, rows: list,
                    out_dir: str) -> list[SystemResult]:
    """Every system's server up at once (each warmed up as it starts), then run i of
    each in turn. Run one system after another and a VM whose speed drifts over the
    minutes of an invocation (this project's 2-core VMs do, by up to 1.5x) hands the
    slow minutes to whichever ran then; in turns, every system gets every minute.
    Idle servers wait on their sockets; each run starts once the machine is quiet
    (``wait_until_quiet``: the run before it may leave threads spinning down)."""
    from benchmarks.peers.servers import free_port, wait_until_quiet

    results = {s.name: SystemResult(s.name, dtype, note=s.note) for s in systems}
    with contextlib.ExitStack() as stack:
        up: list[tuple[System, str]] = []
        for system in systems:
            res = results[system.name]
            server_spec = system.server(ctx, dtype, free_port())
            log = os.path.join(out_dir, f"{system.name}-{dtype}.server.log")
            try:
                server = stack.enter_context(Server(server_spec, log))
                res.startup_s = server.startup_s
                print(f"   {system.name} ready after {server.startup_s:.0f}s at "
                      f"{server_spec.base_url}", flush=True)
                if args.warmup:
                    bench(system, server_spec.base_url, ctx, warmup, spec.seed + 1, True,
                          os.path.join(out_dir, f"{system.name}-{dtype}-warmup.json"))
            except (ServerError, BenchError, OSError) as e:
                res.error = str(e).splitlines()[0]
                print(f"   error: {e}", flush=True)
                continue
            up.append((system, server_spec.base_url))
        for i in range(args.runs):
            for system, base_url in up:
                res = results[system.name]
                if res.error:
                    continue
                if wait_until_quiet() >= 10.0:
                    print("   warning: the machine was not quiet after 10 s", flush=True)
                try:
                    measured_run(system, base_url, ctx, workload, spec, rows, out_dir, i, res)
                except (BenchError, OSError) as e:
                    res.error = str(e).splitlines()[0]
                    print(f"   error: {e}", flush=True)
                    continue
                print(f"   run {i + 1} {system.name}: {res.runs[-1].tokens_per_s:.1f} "
                      "tokens/s", flush=True)
    return [results[s.name] for s in systems]


def measured_run(system: System, base_url: str, ctx: Context, workload: str,
                 spec: WorkloadSpec | TraceSpec, rows: list, out_dir: str, i: int,
                 res: SystemResult) -> None:
    """Measured run i of one server into res: its figures, and a note where its
    records do not match the workload."""
    out = os.path.join(out_dir, f"{system.name}-{res.dtype}-run{i + 1}.json")
    summary = bench(system, base_url, ctx, workload, spec.seed, at_once(spec), out)
    res.runs.append(RunFigures.from_summary(summary))
    found = record_mismatches(out.replace(".json", ".records.jsonl"), rows)
    if found:
        print(f"   warning: run {i + 1}: {found.describe()}", flush=True)
        res.note += f"; run {i + 1}: {found.describe()}"


def bench(system: System, base_url: str, ctx: Context, workload: str, seed: int,
          all_at_once: bool, out: str) -> dict:
    """One `conveyor bench --backend openai` run; its summary (as saved with --out)."""
    cmd = [sys.executable, "-m", "conveyor.entrypoints.cli", "bench", "--backend", "openai",
           "--base-url", base_url, "--openai-model", SERVED_NAME, "--model", ctx.checkpoint,
           *bench_workload_argv(workload, seed, all_at_once), "--out", out, "--no-progress",
           *system.bench_args]
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "src")}
    log = out.replace(".json", ".log")
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if rc != 0:
        raise BenchError(f"conveyor bench exited {rc}; see {log}:\n{tail(log)}")
    with open(out) as f:
        summary = json.load(f)["runs"][0]["summary"]
    if summary["num_failed"]:
        print(f"   warning: {summary['num_failed']} request(s) failed; see {log}", flush=True)
    return summary


def run_hf_generate(system: System, dtype: str, ctx: Context, args: argparse.Namespace,
                    workload: str, spec: WorkloadSpec, out_dir: str) -> SystemResult:
    from conveyor.bench.metrics import RequestRecord, summarize

    res = SystemResult(system.name, dtype, note=system.note)
    with open(os.path.join(ctx.checkpoint, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    reqs_path = os.path.join(out_dir, "requests.json")
    write_requests_json(reqs_path, load_requests(workload, spec.seed, vocab))
    out = os.path.join(out_dir, f"{system.name}-{dtype}.json")
    log = os.path.join(out_dir, f"{system.name}-{dtype}.log")
    cmd = [ctx.paths.python("transformers"), os.path.join(HERE, "hf_generate.py"),
           "--model", ctx.checkpoint, "--dtype", dtype, "--requests", reqs_path, "--out", out,
           "--runs", str(args.runs), "--threads", str(ctx.threads),
           "--warmup" if args.warmup else "--no-warmup"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(log, "w") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if rc != 0:
        res.error = f"hf_generate.py exited {rc}; see {log}"
        print(f"   error: {res.error}\n{tail(log)}", flush=True)
        return res
    with open(out) as f:
        doc = json.load(f)
    res.startup_s = doc["load_s"]
    for i, run in enumerate(doc["runs"]):
        records = [RequestRecord.from_dict(r) for r in run["records"]]
        summary = summarize(records, run["duration_s"], extra={"backend": "hf-generate"})
        with open(os.path.join(out_dir, f"{system.name}-{dtype}-run{i + 1}.json"), "w") as f:
            json.dump({"runs": [{"label": system.name, "summary": summary.to_dict()}]}, f,
                      indent=1, default=str)
        res.runs.append(RunFigures.from_summary(summary.to_dict()))
    return res


def save(out_dir: str, results: dict[str, list[SystemResult]], args: argparse.Namespace,
         spec: WorkloadSpec | TraceSpec, checkpoints: dict[str, str], wall_s: float) -> None:
    doc = {"argv": sys.argv, "workload": spec.describe(), "checkpoints": checkpoints,
           "threads": args.threads, "runs": args.runs, "wall_s": wall_s,
           "results": {d: [r.to_dict() for r in res] for d, res in results.items()}}
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(doc, f, indent=1, default=str)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(f"`python -m benchmarks.peers.run {shlex.join(sys.argv[1:])}`: "
                f"{spec.describe()}, median of {args.runs} run(s), {args.threads} threads, "
                f"wall time {wall_s / 60:.1f} min\n\n")
        for dtype, res in results.items():
            f.write(format_table(res, dtype) + "\n\n")


if __name__ == "__main__":
    sys.exit(main())
