"""Engine arguments: what a CUDA device leaves the KV pool (--gpu-memory-utilization), and
feature combinations refused before anything loads."""

from __future__ import annotations

import argparse

import pytest


def test_gpu_memory_utilization_leaves_the_kv_pool_the_rest() -> None:
    from conveyor.config import EngineArgs, gpu_kv_cache_bytes

    gib = 2**30
    # 80 GiB at 0.9: 72 GiB for the engine; weights + a full step peaked at 18 GiB and
    # the CUDA context holds 1 GiB outside torch: 53 GiB of KV.
    assert gpu_kv_cache_bytes(80 * gib, 0.9, 18 * gib, 1 * gib) == 53 * gib
    assert gpu_kv_cache_bytes(80 * gib, 0.5, 18 * gib, 1 * gib) == 21 * gib
    with pytest.raises(ValueError, match="no room for a KV cache"):
        gpu_kv_cache_bytes(80 * gib, 0.2, 18 * gib, 1 * gib)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        gpu_kv_cache_bytes(80 * gib, 1.5, 0, 0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineArgs(model="tiny", gpu_memory_utilization=0.0)
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--gpu-memory-utilization", "0.5"]))
    assert args.cache_config().gpu_memory_utilization == 0.5


@pytest.mark.gpu
def test_cuda_pool_takes_what_the_profiled_step_leaves() -> None:
    import torch

    from conveyor import LLM

    total = torch.cuda.mem_get_info()[1]
    half = LLM("qwen3-0.6b", load_format="dummy", device="cuda", dtype="bfloat16",
               gpu_memory_utilization=0.5, max_num_batched_tokens=2048)
    kv = half.engine.config.cache.num_kv_blocks * 16 * half.engine.config.model.kv_bytes_per_token
    assert 0.2 * total < kv < 0.5 * total
    assert torch.cuda.memory_allocated() < 0.5 * total


def test_disaggregation_with_tensor_parallelism_is_refused_clearly() -> None:
    from conveyor.config import EngineArgs

    with pytest.raises(ValueError, match="does not support tensor parallelism"):
        EngineArgs(model="tiny", kv_role="prefill", kv_port=9100, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="does not support tensor parallelism"):
        EngineArgs(model="tiny", kv_role="decode", distributed_executor_backend="ray")
