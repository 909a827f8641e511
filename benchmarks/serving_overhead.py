"""What serving over HTTP costs: the same requests offline (``LLM.generate``) and through
``conveyor serve`` with concurrent streaming clients, measured side by side in one run.

    python benchmarks/serving_overhead.py                       # tiny dummy-weight model
    python benchmarks/serving_overhead.py --model PATH --num-requests 128 --max-tokens 64

Prints the parameters, generated tokens/s of each path and their ratio. The server runs
in a subprocess; the offline run happens first, while the server sits idle, so the two
do not share the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
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
    args = parser.parse_args()
    engine_flags = {"max_num_seqs": args.max_num_seqs, "num_threads": args.num_threads,
                    "attention_backend": args.attention_backend}
    print(f"parameters: {vars(args)}")
    prompts = prompts_for(args.num_requests)

    port = free_port()
    cmd = [sys.executable, "-m", "conveyor.serve", "--model", args.model, "--port", str(port),
           "--log-level", "warning", "--no-access-log"]
    for key, value in engine_flags.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    server = subprocess.Popen(cmd, env=dict(os.environ))
    try:
        llm = LLM(args.model, **engine_flags)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:2], params)  # warm up
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        offline_s = time.perf_counter() - t0
        offline_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        del llm

        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.2)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        asyncio.run(run_clients(url, model, prompts[:2], args.max_tokens))  # warm up
        t0 = time.perf_counter()
        http_tokens = asyncio.run(run_clients(url, model, prompts, args.max_tokens))
        http_s = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait()
    offline_rate, http_rate = offline_tokens / offline_s, http_tokens / http_s
    print(f"offline LLM.generate: {offline_tokens} tokens in {offline_s:.2f} s = "
          f"{offline_rate:.0f} tokens/s")
    print(f"HTTP, {args.num_requests} concurrent streaming clients: {http_tokens} tokens in "
          f"{http_s:.2f} s = {http_rate:.0f} tokens/s")
    print(f"HTTP / offline throughput ratio: {http_rate / offline_rate:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
