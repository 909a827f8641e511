"""The engine on a CUDA device (``@pytest.mark.gpu``: skipped without one, see conftest).

What runs on a GPU today is the eager path: the ``sdpa`` attention backend (gather +
``scaled_dot_product_attention``) and ``F.linear``. These tests hold it to the same
reference as the CPU path: float32 greedy tokens equal transformers', half precision
agrees on the first tokens, and the backends chosen are the ones that apply to CUDA.
"""

from __future__ import annotations

import pytest
import torch

from conveyor import LLM, SamplingParams

from helpers import hf_greedy, make_checkpoint, random_prompts

pytestmark = pytest.mark.gpu


def test_cuda_picks_the_backends_that_apply_there() -> None:
    llm = LLM(make_checkpoint("llama"), device="cuda", num_kv_blocks=64)
    runner = llm.engine.runner
    assert runner.device.type == "cuda" and runner.kv_caches[0][0].is_cuda
    assert runner.attention.name == "sdpa" and runner.linear_backend == "torch"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_float32_greedy_equals_transformers_on_cuda(arch: str) -> None:
    path = make_checkpoint(arch)
    llm = LLM(path, device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=8,
              max_num_batched_tokens=64)  # chunked prefill, continuous batching
    prompts = random_prompts(6, seed=11)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=12, temperature=0.0))
    for out, prompt in zip(outs, prompts):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 12)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_on_cuda_agrees_on_the_first_tokens(dtype: str) -> None:
    path = make_checkpoint("llama")
    llm = LLM(path, device="cuda", dtype=dtype, num_kv_blocks=256)
    assert llm.engine.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    prompts = random_prompts(4, seed=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=4, temperature=0.0))
    agree = sum(o.outputs[0].token_ids[0] == hf_greedy(path, p, 1)[0]
                for o, p in zip(outs, prompts))
    assert agree >= 3


def test_seeded_sampling_on_cuda_does_not_depend_on_the_batch() -> None:
    path = make_checkpoint("llama")
    llm = LLM(path, device="cuda", num_kv_blocks=256)
    prompts = random_prompts(4, seed=2)
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=123)
    alone = llm.generate([{"prompt_token_ids": prompts[0]}], params)[0].outputs[0].token_ids
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert batch[0].outputs[0].token_ids == alone
