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
    # triton where it is installed (measured against sdpa under auto), else sdpa
    assert runner.attention.name in ("triton", "sdpa") and runner.linear_backend == "torch"


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


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_triton_backend_greedy_equals_transformers_on_cuda(arch: str) -> None:
    """The unified Triton kernel compiled for the device: float32 (IEEE dots) greedy tokens
    equal transformers' with chunked prefill, prefix hits and a sliding window (mistral)."""
    pytest.importorskip("triton")
    path = make_checkpoint(arch)
    llm = LLM(path, device="cuda", dtype="float32", attention_backend="triton",
              num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=32)
    assert llm.engine.runner.attention.name == "triton"
    prompts = random_prompts(6, seed=13)
    prompts += [prompts[0] + [5, 6, 7]]  # a prefix hit
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=12, temperature=0.0))
    for out, prompt in zip(outs, prompts):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 12)


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_whole_step_kernels_match_sdpa_on_cuda_in_half_precision(dtype, backend) -> None:
    """A decode row and a fresh prompt in one step: the unified kernels (the KV write
    included) against the SDPA reference."""
    pytest.importorskip(backend)
    from conveyor.model.attention.metadata import AttentionMetadata, PrefillSegment
    from conveyor.model.attention.paged import paged_attention
    from conveyor.model.attention.registry import select_attention_backend
    from conveyor.model.attention.sdpa import sdpa_decode

    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d, n = 32, 8, 128, 300
    kc, vc = (torch.randn(1024, hkv, d, device="cuda", generator=g, dtype=dtype)
              for _ in "kv")
    q = torch.randn(1 + n, hq, d, device="cuda", generator=g, dtype=dtype)
    k, v = (torch.randn(1 + n, hkv, d, device="cuda", generator=g, dtype=dtype) for _ in "kv")
    slots = torch.arange(500, 501 + n, device="cuda")
    ctx = torch.arange(0, 200, device="cuda")
    meta = AttentionMetadata(
        slot_mapping=slots, num_decodes=1, decode_slots=torch.cat([ctx, slots[:1]])[None],
        decode_lens=torch.tensor([201], dtype=torch.int32, device="cuda"),
        decode_starts=torch.zeros(1, dtype=torch.int32, device="cuda"),
        decode_mask=torch.ones(1, 201, dtype=torch.bool, device="cuda"),
        decode_kernel=sdpa_decode, prefills=[PrefillSegment(1, n)])
    want = paged_attention(q, k, v, kc.clone(), vc.clone(), meta, d ** -0.5)
    meta.decode_kernel = select_attention_backend(backend, "cuda", dtype, hq, hkv,
                                                  d).decode_kernel()
    got = paged_attention(q, k, v, kc, vc, meta, d ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_cuda_graph_decode_steps_equal_eager_and_transformers() -> None:
    """Decode steps replayed from CUDA graphs (triton attention, padded batch sizes) give
    transformers' greedy tokens, as ``--enforce-eager`` does."""
    pytest.importorskip("triton")
    path = make_checkpoint("llama")
    prompts = random_prompts(7, seed=17)  # 7 rows: padded to 8
    params = SamplingParams(max_tokens=10, temperature=0.0)
    got = {}
    for eager in (True, False):
        llm = LLM(path, device="cuda", dtype="float32", attention_backend="triton",
                  num_kv_blocks=256, max_num_seqs=8, enforce_eager=eager)
        graphs = llm.engine.runner.decode_graphs
        assert (graphs is None) == eager
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        got[eager] = [o.outputs[0].token_ids for o in outs]
        if not eager:
            assert graphs.num_replays > 0 and graphs.graphs
    assert got[True] == got[False]
    for toks, prompt in zip(got[False], prompts):
        assert toks == hf_greedy(path, prompt, 10)


def test_device_sampler_on_cuda_equals_the_cpu_one() -> None:
    """The batched sampler with pinned staging on CUDA: greedy tokens and logprobs as on
    the CPU (same logits), penalties applied on the device."""
    from conveyor.runner.sampler import Sampler, SamplingRow

    rows = [SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=1.2,
                                       frequency_penalty=0.3, min_tokens=2, logprobs=3),
                        [1, 2, 3, 4], [5, 6, 5]) for _ in range(5)]
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(0))
    cpu = Sampler(300, torch.device("cpu"))(logits, rows)
    gpu = Sampler(300, torch.device("cuda"))(logits.cuda(), rows)
    assert gpu.token_ids == cpu.token_ids
    for a, b in zip(gpu.logprobs, cpu.logprobs):
        assert a[0] == b[0] and a[2] == b[2] and abs(a[3] - b[3]) < 1e-5


def test_flashinfer_backend_agrees_with_transformers_on_the_first_tokens() -> None:
    pytest.importorskip("flashinfer")
    path = make_checkpoint("llama")
    llm = LLM(path, device="cuda", dtype="bfloat16", attention_backend="flashinfer",
              num_kv_blocks=256, max_num_batched_tokens=32)  # chunked prefill
    assert llm.engine.runner.attention.name == "flashinfer"
    prompts = random_prompts(4, seed=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=4, temperature=0.0))
    agree = sum(o.outputs[0].token_ids[0] == hf_greedy(path, p, 1)[0]
                for o, p in zip(outs, prompts))
    assert agree >= 3
