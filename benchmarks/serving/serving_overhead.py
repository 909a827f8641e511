"""What serving over HTTP costs: the same requests offline (``LLM.generate``) and through
``conveyor serve`` with concurrent streaming clients, the engine loop in a thread of the
server (``--engine-core thread``) and in its own process (``--engine-core process``, the
default), measured side by side in one run.

    python -m benchmarks.serving.serving_overhead   # tiny dummy-weight model
    python -m benchmarks.serving.serving_overhead --model smollm2-135m --load-format dummy \
        --num-threads 2 --num-requests 64 --max-tokens 64 --rounds 3

Prints the parameters, generated tokens/s of each path (median over rounds) and their
ratios to offline. Both servers run in subprocesses and sit idle while another path is
measured; the paths take turns within each round, so machine noise hits all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx
from openai import AsyncOpenAI

from conveyor import LLM, SamplingParams


def prompts_for(n: int) -> list[str]:
    words = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(8 + i % 24))
            for i in range(n)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_clients(url: str, model: str, prompts: list[str], max_tokens: int) -> int:
    async with AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        async def one(prompt: str) -> int:
            stream = await client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            usage = 0
            async for chunk in stream:
                if chunk.usage:
                    usage = chunk.usage.completion_tokens
            return usage

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--attention-backend", default="sdpa")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    engine_flags = {"max_num_seqs": args.max_num_seqs, "num_threads": args.num_threads,
                    "attention_backend": args.attention_backend,
                    "load_format": args.load_format}
    print(f"parameters: {vars(args)}")
    prompts = prompts_for(args.num_requests)

    servers = {core: start_server(args.model, engine_flags, core)
               for core in ("thread", "process")}
    try:
        llm = LLM(args.model, **engine_flags)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:2], params)  # warm up
        urls = {core: wait_ready(*server) for core, server in servers.items()}
        models = {}
        for core, url in urls.items():
            models[core] = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            asyncio.run(run_clients(url, models[core], prompts[:2], args.max_tokens))
        rates: dict[str, list[float]] = {"offline": [], "thread": [], "process": []}
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            rates["offline"].append(tokens / (time.perf_counter() - t0))
            for core, url in urls.items():
                t0 = time.perf_counter()
                tokens = asyncio.run(run_clients(url, models[core], prompts, args.max_tokens))
                rates[core].append(tokens / (time.perf_counter() - t0))
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait()
    offline = statistics.median(rates["offline"])
    print(f"generated tokens/s, median of {args.rounds} round(s), {args.num_requests} "
          f"requests x {args.max_tokens} tokens:")
    print(f"  offline LLM.generate:                 {offline:8.1f}")
    for core in ("thread", "process"):
        rate = statistics.median(rates[core])
        print(f"  HTTP, engine loop in a {core:<7}:      {rate:8.1f}  "
              f"({rate / offline:.2f}x offline; rounds {[round(r, 1) for r in rates[core]]})")
    return 0


def start_server(model: str, engine_flags: dict, engine_core: str
                 ) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "conveyor.serve", "--model", model, "--port", str(port),
           "--log-level", "warning", "--no-access-log", "--engine-core", engine_core]
    for key, value in engine_flags.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return subprocess.Popen(cmd, env=dict(os.environ)), port


def wait_ready(server: subprocess.Popen, port: int) -> str:
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
