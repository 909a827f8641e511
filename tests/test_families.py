"""The families beyond Llama's four (Phi-3, Granite, OLMo 2, Gemma 2, Gemma 3 text):
greedy token ids equal transformers' for every request, with sliding windows shorter
than the prompts, under batching, chunked prefill, preemption, prefix-cache hits and
either attention backend."""

from __future__ import annotations

import functools
import random
import tempfile

import pytest
import torch
from test_exactness import reference

from conveyor import LLM, SamplingParams
from conveyor.distributed.parallel import SINGLE

from helpers import random_prompts

_BASE = dict(vocab_size=384, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

FAMILIES = {
    "phi3": ("Phi3Config", dict(sliding_window=20, tie_word_embeddings=False)),
    # Phi-3's longrope: short factors below the original length (every test sequence),
    # cos/sin scaled by its attention factor (max_position_embeddings 4x the original).
    "phi3_longrope": ("Phi3Config", dict(
        original_max_position_embeddings=128,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0, 4.1, 5.5],
                         "long_factor": [1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0],
                         "original_max_position_embeddings": 128})),
    "granite": ("GraniteConfig", dict(embedding_multiplier=2.0, attention_multiplier=0.2,
                                      residual_multiplier=0.5, logits_scaling=3.0)),
    "olmo2": ("Olmo2Config", dict()),
    # Soft caps small enough to bite; windows shorter than most prompts.
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=12,
                                    num_hidden_layers=3, attn_logit_softcapping=0.5,
                                    final_logit_softcapping=5.0)),
    "gemma3": ("Gemma3TextConfig", dict(
        head_dim=16, query_pre_attn_scalar=16, sliding_window=12, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1000000.0}})),
    # Mixture of experts: renormalized top-2 of 4 (Mixtral), top-3 of 6 without (Qwen3).
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                      intermediate_size=48, sliding_window=20)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=6, num_experts_per_tok=3,
                                         moe_intermediate_size=40, norm_topk_prob=False,
                                         head_dim=32)),
    "qwen3_moe_norm": ("Qwen3MoeConfig", dict(num_experts=6, num_experts_per_tok=2,
                                              moe_intermediate_size=40, norm_topk_prob=True)),
}


@functools.cache
def checkpoint(family: str) -> str:
    """A tiny random checkpoint written by transformers (norm weights random too, so a
    (1 + w) norm differs from a w one)."""
    import transformers as tf

    from conveyor.config.presets import save_synthetic_tokenizer

    cls_name, overrides = FAMILIES[family]
    cfg = getattr(tf, cls_name)(**{**_BASE, **overrides})
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(p + torch.randn_like(p) * 0.1)
            else:
                p.normal_(0.0, 0.08)
    path = tempfile.mkdtemp(prefix=f"conveyor-{family}-")
    model.save_pretrained(path, safe_serialization=True)
    save_synthetic_tokenizer(path, cfg.vocab_size)
    return path


def _batch(n: int = 8, seed: int = 0):
    rng = random.Random(seed)
    prompts = random_prompts(n, lo=2, hi=50, seed=seed)
    return prompts, [SamplingParams(max_tokens=rng.randint(1, 16), temperature=0.0)
                     for _ in prompts]


def _check(path: str, outs, prompts, params) -> None:
    for i, (out, prompt, sp) in enumerate(zip(outs, prompts, params)):
        want = reference(path, tuple(prompt), sp.max_tokens)
        got = out.outputs[0].token_ids
        assert got == want, f"request {i} (prompt {len(prompt)} tokens): {got} != {want}"


def _native_missing() -> bool:
    from conveyor.kernels import cpu as kernels

    return kernels.load() is None


CONFIGS = {
    "default": dict(),
    "chunked": dict(max_num_batched_tokens=13),
    "preempt": dict(num_kv_blocks=9, block_size=8),
    "sdpa_attention": dict(attention_backend="sdpa", max_num_batched_tokens=40),
    "native_attention": dict(attention_backend="native", max_num_batched_tokens=40),
}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_transformers(family: str, config: str) -> None:
    if config == "native_attention" and _native_missing():
        pytest.skip("native kernels unavailable")
    path = checkpoint(family)
    llm = LLM(path, dtype="float32", **CONFIGS[config])
    prompts, params = _batch()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    _check(path, outs, prompts, params)
    stats = llm.stats()
    if config == "preempt":
        assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_in_use"] == 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefix_hits_match_transformers(family: str) -> None:
    """Cached prefixes, longer than the window where there is one: the windowed layers'
    views start past the cached blocks, the global layers' read them all."""
    path = checkpoint(family)
    rng = random.Random(7)
    base = [rng.randrange(4, 384) for _ in range(40)]
    prompts = [base[:19] + [12, 13], base[:40], base[:40] + [14], base[:33]]
    params = [SamplingParams(max_tokens=6, temperature=0.0) for _ in prompts]
    llm = LLM(path, dtype="float32", block_size=8, num_kv_blocks=64, max_num_seqs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    _check(path, outs, prompts, params)
    assert llm.stats()["prefix_cache_hits"] > 0


def test_layer_windows_follow_the_family_pattern() -> None:
    from conveyor.model.models.decoder import layer_windows
    from conveyor.model.models.registry import model_class

    hf = {"sliding_window": 8}
    assert model_class("Gemma2ForCausalLM").layer_types(hf, 4) == [
        "sliding_attention", "full_attention"] * 2
    types = model_class("Gemma3ForCausalLM").layer_types(hf, 7)
    assert types == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert layer_windows(hf, 7, True, types) == [8] * 5 + [None, 8]
    assert layer_windows(hf, 2, False, None) == [None, None]  # windows off by default


def test_unsupported_rope_variants_are_refused_by_name() -> None:
    from conveyor.model.layers.rotary import rope_inv_freq

    with pytest.raises(ValueError, match="partial_rotary_factor"):
        rope_inv_freq({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.75}},
                      16)
    with pytest.raises(ValueError, match="'yarn'"):
        rope_inv_freq({"rope_parameters": {"rope_type": "yarn"}}, 16)


def test_longrope_uses_long_factors_from_the_original_length_on() -> None:
    from conveyor.model.layers.rotary import RotaryEmbedding

    hf = {"max_position_embeddings": 64, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 100.0, "short_factor": [1.0, 2.0],
        "long_factor": [3.0, 5.0], "original_max_position_embeddings": 16}}
    rope = RotaryEmbedding(hf, 4, 64)
    scale = (1 + torch.log(torch.tensor(4.0)) / torch.log(torch.tensor(16.0))).sqrt()
    inv_short = 1.0 / (torch.tensor([1.0, 2.0]) * 100.0 ** torch.tensor([0.0, 0.5]))
    inv_long = 1.0 / (torch.tensor([3.0, 5.0]) * 100.0 ** torch.tensor([0.0, 0.5]))
    torch.testing.assert_close(rope.cos[15, :2], (15 * inv_short).cos() * scale)
    torch.testing.assert_close(rope.cos[40, :2], (40 * inv_long).cos() * scale)


@pytest.mark.parametrize("family", ["gemma2", "granite", "gemma3"])
def test_logits_match_transformers_within_1e4(family: str) -> None:
    """Logits, not just their argmax: Gemma 2's final soft cap and Granite's scaling are
    monotonic, invisible to greedy ids."""
    from helpers import hf_model

    path = checkpoint(family)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=20)
    runner = llm.engine.runner
    runner.record_logits = True
    for i, p in enumerate(random_prompts(3, lo=5, hi=30, seed=3)):
        llm.engine.add_request({"prompt_token_ids": p}, SamplingParams(
            max_tokens=4, temperature=0.0), request_id=str(i))
    model = hf_model(path)
    seen = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        for rid, logits in runner.last_logits.items():
            state = runner.requests[rid]
            with torch.no_grad():
                want = model(torch.tensor([state.tokens(0, state.num_tokens - 1)])).logits[0, -1]
            torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)
            seen += 1
    assert seen == 3 * 4


def test_gemma3_older_configs_name_the_local_base_apart() -> None:
    """transformers 4's Gemma 3 config.json: ``rope_theta`` and ``rope_scaling`` for the
    global layers, ``rope_local_base_freq`` (unscaled) for the sliding ones."""
    from conveyor.model.layers.rotary import rope_inv_freq

    hf = {"rope_theta": 1e6, "rope_local_base_freq": 1e4,
          "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    exponent = torch.arange(0, 16, 2, dtype=torch.int64).float() / 16
    torch.testing.assert_close(rope_inv_freq(hf, 16, "sliding_attention"),
                               1.0 / (1e4 ** exponent))
    torch.testing.assert_close(rope_inv_freq(hf, 16, "full_attention"),
                               1.0 / (1e6 ** exponent) / 8.0)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_block_equals_transformers_bit_for_bit(family: str, dtype: torch.dtype) -> None:
    """The sparse block alone on transformers' own block's weights: grouped by expert,
    its output equals transformers' eager experts exactly, bf16 included (Mixtral scales
    by float32 weights, Qwen3-MoE by rounded ones), and its default (``grouped_mm``:
    ``torch._grouped_mm``) to rounding."""
    import transformers

    from conveyor.model.layers.moe import moe_block

    cls_name, overrides = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**{**_BASE, **overrides})
    torch.manual_seed(1)
    theirs = transformers.AutoModelForCausalLM.from_config(
        cfg, experts_implementation="eager").model.layers[0].mlp
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.1)
    theirs = theirs.to(dtype).eval()
    hf = cfg.to_dict()
    if family == "mixtral":
        hf = {**hf, "norm_topk_prob": True, "moe_intermediate_size": None}
    ours = moe_block(hf, cfg.hidden_size, SINGLE, float32_weights=family == "mixtral")
    ours = ours.to(dtype)
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.gate.weight)
        for e, expert in enumerate(ours.experts):
            expert.gate_up_proj.weight.copy_(theirs.experts.gate_up_proj[e])
            expert.down_proj.weight.copy_(theirs.experts.down_proj[e])
        x = torch.randn(37, cfg.hidden_size).to(dtype)
        assert torch.equal(ours(x), theirs(x[None])[0])
        theirs.experts.config._experts_implementation = "grouped_mm"
        tol = 1e-6 if dtype is torch.float32 else 2e-2
        torch.testing.assert_close(ours(x), theirs(x[None])[0], atol=tol, rtol=0)


def test_a_draft_model_with_per_layer_windows_is_refused_at_start() -> None:
    path = checkpoint("gemma2")
    with pytest.raises(ValueError, match="per-layer sliding windows"):
        LLM(path, dtype="float32", speculative_config={
            "method": "draft_model", "model": path, "num_speculative_tokens": 2})


@pytest.mark.parametrize("family", ["phi3", "granite", "olmo2", "gemma2", "gemma3", "mixtral",
                                    "qwen3_moe"])
def test_bfloat16_runs_and_mostly_agrees(family: str) -> None:
    """bf16 arithmetic cannot be bit-exact with float32's: it must run (soft caps, GeGLU,
    experts in bf16) and agree on the first tokens."""
    path = checkpoint(family)
    llm = LLM(path, dtype="bfloat16", compute_dtype="bfloat16")
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    prompts = random_prompts(4, seed=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=2, temperature=0.0))
    agree = sum(o.outputs[0].token_ids[0] == reference(path, tuple(p), 2)[0]
                for o, p in zip(outs, prompts))
    assert agree >= 3


@pytest.mark.skipif(_native_missing(), reason="native kernels unavailable")
@pytest.mark.parametrize("batch", [1, 3, 16, 70])
def test_grouped_experts_equal_one_gemm_per_expert_bit_for_bit(batch: int) -> None:
    """Experts on conveyor's GEMM run grouped (two native calls, each expert whole on one
    thread): every token's output is the bits of the one-call-per-expert path."""
    from conveyor.model.layers.moe import SparseMoE
    from conveyor.model.linear.native import NativeLinear, native_gemm_lib

    if native_gemm_lib() is None:
        pytest.skip("no AVX2 + FMA GEMM on this CPU")
    torch.manual_seed(batch)
    block = SparseMoE(64, 40, 6, 2, renormalize=True)
    for expert in block.experts:
        expert.gate_up_proj = NativeLinear(torch.randn(80, 64) * 0.1, None, native_gemm_lib(),
                                           gate_up=True)
        expert.down_proj = NativeLinear(torch.randn(64, 40) * 0.1, None, native_gemm_lib())
    x = torch.randn(batch, 64)
    assert block.grouped_gemms() is not None
    grouped = block(x)
    block.grouped_gemms = lambda: None  # the loop: one GEMM call per active expert
    assert torch.equal(grouped, block(x))


@pytest.mark.skipif(_native_missing(), reason="native kernels unavailable")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_experts_run_grouped_at_the_defaults_whatever_one_gemm_measured(
        monkeypatch, dtype: str) -> None:
    """``linear_backend=auto`` measures one projection's GEMM per shape; the experts run
    as one grouped native call instead, so they stay on conveyor's GEMM (grouped) even
    where that measurement picked another backend for every shape (as a loaded machine
    once did), and the rest takes the measured choice."""
    from conveyor.model.autotune import linears as linear_choice
    from conveyor.model.layers.moe import SparseMoE
    from conveyor.model.linear.native import NativeLinear, native_gemm_lib

    if native_gemm_lib() is None:
        pytest.skip("no AVX2 + FMA GEMM on this CPU")
    monkeypatch.setenv("CONVEYOR_MEASURE_LINEARS", "1")
    measured = []

    def onednn_everywhere(shapes, backends, *args, **kwargs):
        measured.extend(s.key for s in shapes)
        return {s.key: "onednn" for s in shapes}

    monkeypatch.setattr(linear_choice, "choose", onednn_everywhere)
    path = checkpoint("mixtral")
    llm = LLM(path, dtype=dtype)
    runner = llm.engine.runner
    if runner.cfg.math_dtype != "float32":  # (native bf16 arithmetic: no native GEMM)
        pytest.skip(f"{dtype} computes in {runner.cfg.math_dtype} on this CPU")
    blocks = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
    assert blocks and all(b.grouped_gemms() is not None for b in blocks)
    assert measured and not any(k.startswith("96x64") or k == "64x48" for k in measured)
    q_proj = runner.model.layers[0].self_attn.qkv_proj
    assert not isinstance(q_proj, NativeLinear)  # the measured choice, onednn
    if dtype == "float32":
        prompts, params = _batch(4, seed=3)
        _check(path, llm.generate([{"prompt_token_ids": p} for p in prompts], params),
               prompts, params)


@pytest.mark.skipif(_native_missing(), reason="native kernels unavailable")
@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("batch", [1, 2, 5, 33])
def test_grouped_experts_in_panel_runs_equal_one_gemm_per_expert(batch: int,
                                                                 bf16: bool) -> None:
    """The grouped call splits an expert's panels into runs over the threads (wide
    experts, few of them active): every output still the bits of the expert's own GEMM,
    float32 and bf16 weights, a last panel part-filled."""
    from conveyor.model.layers.moe import SparseMoE
    from conveyor.model.linear.native import NativeLinear, native_gemm_lib

    lib = native_gemm_lib()
    if lib is None:
        pytest.skip("no AVX2 + FMA GEMM on this CPU")
    torch.manual_seed(100 + batch)
    hidden, inter = 72, 300  # 38 gate/up panels (the last half full), 5 down panels
    block = SparseMoE(hidden, inter, 3, 1, renormalize=True)

    def weight(*shape):
        w = torch.randn(*shape) * 0.1
        return w.to(torch.bfloat16).float() if bf16 else w

    for expert in block.experts:
        expert.gate_up_proj = NativeLinear(weight(2 * inter, hidden), None, lib, gate_up=True,
                                           bf16_weight=bf16)
        expert.down_proj = NativeLinear(weight(hidden, inter), None, lib, bf16_weight=bf16)
    x = torch.randn(batch, hidden)
    assert block.grouped_gemms() is not None
    grouped = block(x)
    block.grouped_gemms = lambda: None
    assert torch.equal(grouped, block(x))
