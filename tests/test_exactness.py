"""Greedy token ids equal transformers' for every request, whatever the batching."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from conveyor import LLM, SamplingParams

from helpers import ARCHS, hf_greedy, hf_model, make_checkpoint, random_prompts


@functools.cache
def reference(path: str, prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    return hf_greedy(path, list(prompt), max_tokens)


def mixed_batch(n: int = 10, seed: int = 0):
    rng = random.Random(seed)
    prompts = random_prompts(n, lo=2, hi=70, seed=seed)
    params = [SamplingParams(max_tokens=rng.randint(1, 24), temperature=0.0) for _ in prompts]
    return prompts, params


def check_exact(path: str, outs, prompts, params) -> None:
    for i, (out, prompt, sp) in enumerate(zip(outs, prompts, params)):
        want = reference(path, tuple(prompt), sp.max_tokens)
        got = out.outputs[0].token_ids
        assert got == want, f"request {i} (prompt {len(prompt)} tokens): {got} != {want}"
        assert out.prompt_token_ids == prompt


CONFIGS = {
    "default": dict(),
    "chunked": dict(max_num_batched_tokens=13),  # forces multi-step prefill of most prompts
    "preempt": dict(num_kv_blocks=9, block_size=8),  # 72 slots for 10 requests
    "static": dict(batching="static", max_num_seqs=4),
    "tiny_blocks": dict(block_size=1, num_kv_blocks=600, max_num_batched_tokens=37),
    "no_prefix_cache": dict(enable_prefix_caching=False, max_num_seqs=3),
    "sdpa_attention": dict(attention_backend="sdpa", max_num_batched_tokens=40),
    "native_attention": dict(attention_backend="native", max_num_batched_tokens=40),
    "torch_linears": dict(linear_backend="torch", attention_backend="sdpa"),
    "onednn_linears": dict(linear_backend="onednn", max_num_batched_tokens=40),
    "native_linears": dict(linear_backend="native", attention_backend="sdpa"),
}


def _needs(config: str):
    """Configurations that force a backend this machine may not build skip without it."""
    from conveyor.kernels import cpu as kernels
    from conveyor.model.linear.native import native_gemm_lib
    from conveyor.model.linear.onednn import onednn_available

    backend = CONFIGS[config]
    if backend.get("attention_backend") == "native" and kernels.load() is None:
        return [pytest.mark.skip(reason="native kernels unavailable " +
                                 kernels.why_unavailable())]
    if backend.get("linear_backend") == "native" and native_gemm_lib() is None:
        return [pytest.mark.skip(reason="no native GEMM on this machine")]
    if backend.get("linear_backend") == "onednn" and not onednn_available():
        return [pytest.mark.skip(reason="torch built without oneDNN")]
    return []


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("config", [pytest.param(c, marks=_needs(c)) for c in CONFIGS])
def test_greedy_matches_transformers(arch: str, config: str) -> None:
    path = make_checkpoint(arch)
    llm = LLM(path, dtype="float32", **CONFIGS[config])
    prompts, params = mixed_batch()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    check_exact(path, outs, prompts, params)
    stats = llm.stats()
    if config == "preempt":
        assert stats["num_preemptions"] > 0, "the tiny pool should have forced preemptions"
    if config == "static":
        assert stats["peak_running"] <= 4
    assert stats["kv_blocks_in_use"] == 0, "every block must come back"


def test_shared_prefixes_with_prefix_cache_match_transformers() -> None:
    """Requests sharing prefixes of every alignment hit the cache and stay exact."""
    path = make_checkpoint("llama")
    rng = random.Random(7)
    base = [rng.randrange(4, 384) for _ in range(40)]
    # shorter than a block, exactly 2 blocks, 2 blocks + 3 (block_size 8)
    prompts = [base[:5] + [9, 10], base[:16] + [11], base[:19] + [12, 13], base[:16],
               base[:40], base[:40] + [14]]
    params = [SamplingParams(max_tokens=6, temperature=0.0) for _ in prompts]
    llm = LLM(path, dtype="float32", block_size=8, num_kv_blocks=64, max_num_seqs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    check_exact(path, outs, prompts, params)
    assert llm.stats()["prefix_cache_hits"] > 0
    # A second round is served largely from the cache and is still exact.
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    check_exact(path, outs, prompts, params)
    assert outs[4].num_cached_tokens == 32  # 40 tokens: 5 full blocks, last token recomputed


def test_logits_match_transformers_within_1e4() -> None:
    """One prefill step and the following decode steps, in a mixed batch."""
    path = make_checkpoint("qwen3")
    llm = LLM(path, dtype="float32", max_num_batched_tokens=20)
    runner = llm.engine.runner
    runner.record_logits = True
    prompts = random_prompts(4, lo=5, hi=30, seed=3)
    for i, p in enumerate(prompts):
        llm.engine.add_request({"prompt_token_ids": p}, SamplingParams(max_tokens=5,
                               temperature=0.0), request_id=str(i))
    model = hf_model(path)
    seen = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        for rid, logits in runner.last_logits.items():
            state = runner.requests[rid]
            seq = state.tokens(0, state.num_tokens - 1)  # the sampled token came after
            with torch.no_grad():
                want = model(torch.tensor([seq])).logits[0, -1]
            torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)
            seen += 1
    assert seen == 4 * 5


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_and_mostly_agrees(dtype: str) -> None:
    """Half precision cannot be bit-exact; it must run and agree on the first tokens."""
    path = make_checkpoint("llama")
    llm = LLM(path, dtype=dtype, compute_dtype=dtype)  # half-precision arithmetic too
    assert llm.engine.runner.kv_caches[0][0].dtype == getattr(torch, dtype)
    prompts = random_prompts(4, seed=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=4, temperature=0.0))
    agree = sum(o.outputs[0].token_ids[0] == reference(path, tuple(p), 4)[0]
                for o, p in zip(outs, prompts))
    assert agree >= 3


@functools.cache
def bf16_rounded_copy(path: str) -> str:
    """The checkpoint with every weight rounded to bfloat16, saved back in float32."""
    import tempfile

    from conveyor.config.presets import save_synthetic_tokenizer

    model = hf_model(path)
    rounded = type(model)(model.config)
    with torch.no_grad():
        for (_, mine), (_, theirs) in zip(rounded.named_parameters(), model.named_parameters()):
            mine.copy_(theirs.to(torch.bfloat16).float())
    out = tempfile.mkdtemp(prefix="conveyor-bf16-rounded-")
    rounded.save_pretrained(out, safe_serialization=True)
    save_synthetic_tokenizer(out, model.config.vocab_size)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_weights_with_float32_compute_are_exact(arch: str) -> None:
    """dtype bfloat16 computed in float32 (the default on a CPU without bf16 instructions)
    equals transformers in float32 on the bf16-rounded weights, token for token."""
    path = make_checkpoint(arch)
    llm = LLM(path, dtype="bfloat16", compute_dtype="float32")
    cfg = llm.engine.config.model
    assert (cfg.dtype, cfg.math_dtype, cfg.dtype_label) == (
        "bfloat16", "float32", "bfloat16 (float32 compute)")
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.float32
    prompts, params = mixed_batch(seed=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    check_exact(bf16_rounded_copy(path), outs, prompts, params)


def test_compute_dtype_auto_follows_the_cpu(monkeypatch) -> None:
    from conveyor.model import dtypes

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: False)
    assert dtypes.resolve_compute_dtype("auto", "bfloat16", cpu) == "float32"
    assert dtypes.resolve_compute_dtype("auto", "bfloat16", cuda) == "bfloat16"
    assert dtypes.resolve_compute_dtype("auto", "float16", cpu) == "float16"
    assert dtypes.resolve_compute_dtype("bfloat16", "bfloat16", cpu) == "bfloat16"
    monkeypatch.setattr(dtypes, "cpu_has_native_bf16", lambda: True)
    assert dtypes.resolve_compute_dtype("auto", "bfloat16", cpu) == "bfloat16"
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        dtypes.resolve_compute_dtype("int8", "bfloat16", cpu)


def test_same_step_prefix_sharing_is_exact() -> None:
    """Identical prompts admitted together share blocks computed in that very step."""
    path = make_checkpoint("qwen2")
    prompt = random_prompts(1, lo=37, hi=37, seed=17)[0]
    llm = LLM(path, dtype="float32", block_size=8)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 3 +
                        [{"prompt_token_ids": prompt[:20] + [5, 6]}], params)
    assert llm.stats()["prefix_cache_hits"] == 2 * 32 + 16
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32, 16]
    check_exact(path, outs, [prompt] * 3 + [prompt[:20] + [5, 6]], [params] * 4)
    n3 = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(n=3, max_tokens=5,
                                                                     temperature=0.0))[0]
    assert all(c.token_ids == outs[0].outputs[0].token_ids for c in n3.outputs)
