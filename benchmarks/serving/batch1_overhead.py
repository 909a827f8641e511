"""What the server adds per token at batch 1: one streamed request through ``conveyor
serve`` against the same request's decode steps in process (``LLMEngine.step``), side by
side in one run.

    python -m benchmarks.serving.batch1_overhead --quantization int4
    python -m benchmarks.serving.batch1_overhead --quantization int8 --rounds 3 \
        --arm base=/tmp/base/src --arm new=src     # two trees' servers in turns
    # (the base tree: mkdir /tmp/base && git archive REV src | tar -x -C /tmp/base)

The model is the peers' random SmolLM2-135M checkpoint (``benchmarks/peers/checkpoint``)
in bf16, served with the peers' conveyor flags: one request, a 128-token prompt (token ids),
256 output tokens (``ignore_eos``), streamed over ``/v1/completions``. Server TPOT is the
mean gap between streamed chunks after the first (what ``conveyor bench`` reports; the
median gap beside it), read as ``conveyor bench`` reads streams; the in-process figure is
the mean decode ``LLMEngine.step()`` of the same request in this process (its engine
built once, idle while a server runs). Each round takes every arm in turn, so machine
drift hits all of them; figures pair arms round by round: the gap is the median over
rounds of server TPOT minus that round's in-process step, and with several arms the last
lines are each arm's TPOT over the first arm's (median of the per-round ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import time

import httpx

from benchmarks.peers.checkpoint import ensure_checkpoint
from benchmarks.peers.servers import HOST, Server, ServerSpec, free_port
from benchmarks.peers.systems import CONVEYOR_ARGS

ROOT = os.path.expanduser("~/.cache/conveyor/peers")


def _is_env(token: str) -> bool:
    """An arm's ``NAME=value`` token sets its server's environment (flags start with -)."""
    return "=" in token and not token.startswith("-")


def prompt_ids(n: int) -> list[int]:
    return [16 + (i * 7919) % 40000 for i in range(n)]  # word tokens (checkpoint.py)


def stream_gaps(url: str, prompt: list[int], max_tokens: int,
                client: str = "async") -> tuple[int, list[float]]:
    """(tokens received, seconds between chunks after the first); ``client`` "async" reads
    as the peers' harness does, "sync" with a blocking httpx client."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    if client == "async":
        tokens, times = asyncio.run(_astream_times(url, body))
        return tokens, [b - a for a, b in itertools.pairwise(times)]
    times, tokens = [], 0
    with httpx.Client(timeout=600, trust_env=False) as c, \
            c.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            tokens = _take(line, times) or tokens
    return tokens, [b - a for a, b in itertools.pairwise(times)]


def _take(line: str, times: list[float]) -> int | None:
    """One line of a stream: its arrival time kept if it carries choices; the usage's
    completion tokens if it has them."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    chunk = json.loads(line[6:])
    if chunk.get("choices"):
        times.append(time.perf_counter())
    return chunk["usage"]["completion_tokens"] if chunk.get("usage") else None


async def _astream_times(url: str, body: dict) -> tuple[int, list[float]]:
    """As ``conveyor bench --backend openai`` reads a stream (httpx.AsyncClient, lines)."""
    times, tokens = [], 0
    async with httpx.AsyncClient(timeout=600, trust_env=False) as client, \
            client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            tokens = _take(line, times) or tokens
    return tokens, times


def in_process_steps(engine, prompt: list[int], max_tokens: int) -> list[float]:
    from conveyor import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt, params)
    steps = []
    engine.step()  # the prefill
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t0)
    return steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quantization", default="int4", help="int4, int8 or none (bf16)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--arm", action="append", default=None,
                   help="label=src-folder[:serve flags and NAME=value env], repeatable: a "
                        "server run from that tree, in turns with the others (default: this=src)")
    p.add_argument("--server-args", default="", help="extra `conveyor serve` flags (all trees)")
    p.add_argument("--client", default="async", choices=("async", "sync"),
                   help="async: read streams as conveyor bench does; sync: blocking httpx")
    p.add_argument("--no-offline", action="store_true", help="skip the in-process arm")
    args = p.parse_args()
    print(f"parameters: {vars(args)}")
    print(f"load average: {os.getloadavg()}")
    ckpt = ensure_checkpoint(ROOT, 0, "smollm2")
    quant = [] if args.quantization == "none" else ["--quantization", args.quantization]
    serve_flags = ["--model", ckpt, "--dtype", "bfloat16", "--num-threads",
                   str(args.num_threads), *quant, *CONVEYOR_ARGS,
                   *args.server_args.split()]
    prompt = prompt_ids(args.prompt_tokens)
    servers = {}
    for arm in args.arm or ["this=src"]:
        label, _, rest = arm.partition("=")
        src, _, extra = rest.partition(":")
        port = free_port()
        argv = [sys.executable, "-m", "conveyor.entrypoints.cli", "serve", *serve_flags,
                *[t for t in extra.split() if not _is_env(t)],
                "--host", HOST, "--port", str(port), "--served-model-name", "m",
                "--no-access-log", "--log-level", "warning"]
        env = {"PYTHONPATH": os.path.abspath(src), "PYTHONUNBUFFERED": "1",
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               **dict(t.split("=", 1) for t in extra.split() if _is_env(t))}
        servers[label] = Server(ServerSpec(label, argv, port, env, "/health"),
                                f"/tmp/batch1_overhead_{label}.log")
    engine = None
    try:
        for s in servers.values():
            s.start()
            s.wait_ready()
        if not args.no_offline:
            from conveyor.config import EngineArgs
            from conveyor.engine.llm_engine import LLMEngine

            engine = LLMEngine(EngineArgs(
                model=ckpt, dtype="bfloat16", num_threads=args.num_threads,
                quantization=None if args.quantization == "none" else args.quantization,
                max_num_seqs=128, max_num_batched_tokens=2048, enable_prefix_caching=False))
            in_process_steps(engine, prompt, 16)  # warm up
        for s in servers.values():
            stream_gaps(s.spec.base_url, prompt, 16, args.client)
        gaps: dict[str, list[float]] = {label: [] for label in servers}
        if engine is not None:
            gaps["in-process"] = []
        p50s = {label: [] for label in gaps}
        client_cpu: dict[str, list[float]] = {label: [] for label in servers}
        for _ in range(args.rounds):
            if engine is not None:
                steps = in_process_steps(engine, prompt, args.max_tokens)
                gaps["in-process"].append(statistics.fmean(steps))
                p50s["in-process"].append(statistics.median(steps))
            for label, s in servers.items():
                c0 = time.process_time()
                n, g = stream_gaps(s.spec.base_url, prompt, args.max_tokens, args.client)
                client_cpu[label].append((time.process_time() - c0) / n)
                assert n == args.max_tokens, f"{label}: {n} tokens"
                gaps[label].append(statistics.fmean(g))  # the TPOT bench reports
                p50s[label].append(statistics.median(g))
    finally:
        for s in servers.values():
            s.stop()
    print(f"batch 1, {args.prompt_tokens}-token prompt, {args.max_tokens} tokens, "
          f"{args.quantization}; median of {args.rounds} rounds (ms per token):")
    # Per-round pairs (same minutes of the machine), then the median over rounds.
    ref = gaps.get("in-process")
    first = next(iter(servers))
    for label, g in gaps.items():
        p50 = statistics.median(p50s[label]) * 1e3
        med = statistics.median(g) * 1e3
        extra = ""
        if ref is not None and label != "in-process":
            gap = statistics.median((a - b) * 1e3 for a, b in zip(g, ref))
            extra += f"  gap {gap:+.2f} ms over in-process"
        if label in client_cpu:
            extra += f"  client CPU {statistics.median(client_cpu[label]) * 1e3:.2f} ms/token"
        kind = "in-process decode step" if label == "in-process" else f"server TPOT [{label}]"
        print(f"  {kind:<28} mean {med:6.2f} (p50 {p50:5.2f})  "
              f"rounds {[round(x * 1e3, 2) for x in g]}{extra}")
    for label in list(servers)[1:]:
        ratio = statistics.median(a / b for a, b in zip(gaps[label], gaps[first]))
        print(f"TPOT {label} / {first}: {ratio:.3f} (median of per-round ratios)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
