"""Engine arguments: what a CUDA device leaves the KV pool (--gpu-memory-utilization), and
feature combinations refused before anything loads."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

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


def test_the_config_checks_names_without_core_and_knows_every_registered_one() -> None:
    # The config validates a policy's name before core is imported...
    script = ("import sys; from conveyor.config import SchedulerConfig, PolicyConfig\n"
              "SchedulerConfig(scheduling_policy='slo', policy=PolicyConfig("
              "sjf_predictor='max_tokens'))\n"
              "print(sorted(m for m in sys.modules if m.startswith('conveyor.')"
              " and not m.startswith(('conveyor.config', 'conveyor.envs'))))")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    # ... by the same names as core's registries, and learns a plugin's.
    from conveyor.config import POLICY_NAMES, PREDICTOR_NAMES, PolicyConfig
    from conveyor.core.policies import POLICIES, PREDICTORS, register_predictor

    assert set(POLICIES) == POLICY_NAMES
    assert set(PREDICTORS) == PREDICTOR_NAMES
    with pytest.raises(ValueError, match="sjf_predictor must be one of"):
        PolicyConfig(sjf_predictor="test-config-oracle")
    register_predictor("test-config-oracle", lambda r: 1)
    try:
        assert PolicyConfig(sjf_predictor="test-config-oracle").sjf_predictor \
            == "test-config-oracle"
    finally:
        del PREDICTORS["test-config-oracle"]
        PREDICTOR_NAMES.discard("test-config-oracle")
