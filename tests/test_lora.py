"""Multi-LoRA: greedy tokens equal PEFT's for every adapter and transformers' for the base
model's requests, with several adapters and base requests in one batch, under chunked
prefill, preemption, prefix hits and more adapters in flight than ``max_loras``."""

from __future__ import annotations

import pytest
from lora_helpers import make_adapter, peft_greedy

from conveyor import LLM, LoRARequest, SamplingParams

from helpers import make_checkpoint, random_prompts

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base() -> str:
    return make_checkpoint("llama")


@pytest.fixture(scope="module")
def adapters(base: str) -> list[LoRARequest]:
    paths = [make_adapter(base, 1, r=8),
             make_adapter(base, 2, r=16, alpha=8, rslora=True),
             make_adapter(base, 3, r=4, targets=("q_proj", "v_proj", "down_proj"))]
    return [LoRARequest(f"a{i + 1}", i + 1, p) for i, p in enumerate(paths)]


def check(llm: LLM, base: str, adapters: list[LoRARequest], n: int = 12, seed: int = 0,
          max_tokens: int = 10) -> None:
    prompts = random_prompts(n, lo=3, hi=40, seed=seed)
    loras = [None if i % 4 == 0 else adapters[i % len(adapters)] for i in range(n)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs = llm.generate(prompts, params, lora_request=loras)
    differs = 0
    for i, (out, prompt, lora) in enumerate(zip(outs, prompts, loras)):
        want = peft_greedy(base, lora.lora_path if lora else None, tuple(prompt), max_tokens)
        got = out.outputs[0].token_ids
        assert got == want, f"request {i} ({lora and lora.lora_name}): {got} != {want}"
        if lora is not None:
            differs += got != peft_greedy(base, None, tuple(prompt), max_tokens)
    assert differs > 0, "the adapters should change some continuations"


CONFIGS = {
    "mixed": dict(max_loras=3),
    "chunked": dict(max_loras=3, max_num_batched_tokens=13),
    "preempt": dict(max_loras=3, num_kv_blocks=12, block_size=8),
    "fewer_slots": dict(max_loras=1, max_cpu_loras=2),
    "torch_linears": dict(max_loras=2, linear_backend="torch", attention_backend="sdpa"),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_greedy_equals_peft(base, adapters, config):
    llm = LLM(base, dtype="float32", enable_lora=True, max_lora_rank=16, **CONFIGS[config])
    check(llm, base, adapters)
    if config == "preempt":
        assert llm.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("chunk", [512, 13])
def test_batched_products_equal_peft(base, adapters, monkeypatch, chunk):
    """The batched path (the step's adapters stacked, rows padded per adapter) forced for
    every step with an adapter: still PEFT's tokens; uneven prefill chunks fall back to the
    per-adapter loop within the same run."""
    from conveyor.model.lora import manager

    monkeypatch.setattr(manager, "BATCH_FROM", 1)
    calls = []
    original = manager.batched_rows
    monkeypatch.setattr(manager, "batched_rows",
                        lambda groups: calls.append(r := original(groups)) or r)
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=3,
              max_num_batched_tokens=chunk)
    check(llm, base, adapters)
    assert any(c is not None for c in calls)


def test_prefix_hits_are_per_adapter(base, adapters):
    """The same prompts under the base model, then adapter a1, then a1 again: a1 never
    reads the base model's cached K/V (no hit, exact tokens), and hits its own."""
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, block_size=8)
    prompts = random_prompts(4, lo=20, hi=40, seed=3)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    a1 = adapters[0]
    for lora, hits in ((None, False), (a1, False), (a1, True), (None, True)):
        outs = llm.generate(prompts, params, lora_request=lora)
        for prompt, out in zip(prompts, outs):
            want = peft_greedy(base, lora.lora_path if lora else None, tuple(prompt), 6)
            assert out.outputs[0].token_ids == want
            assert (out.num_cached_tokens > 0) == hits, (lora, out.num_cached_tokens)


def test_bad_adapters_are_refused(base, adapters, tmp_path):
    llm = LLM(base, dtype="float32", enable_lora=True, max_lora_rank=8)
    with pytest.raises(ValueError, match="rank 16, above --max-lora-rank 8"):
        llm.generate([[5, 6, 7]], lora_request=adapters[1])
    with pytest.raises(ValueError, match=r"no adapter_config\.json"):
        llm.generate([[5, 6, 7]], lora_request=LoRARequest("x", 9, str(tmp_path)))
    plain = LLM(base, dtype="float32")
    with pytest.raises(ValueError, match="--enable-lora"):
        plain.generate([[5, 6, 7]], lora_request=adapters[0])


def test_tensor_parallel_2_shards_adapters(base, adapters, monkeypatch):
    """TP = 2 (two gloo processes): each rank holds its part of every adapter, as of the
    layer it adapts; greedy tokens still equal PEFT's for each adapter and the base."""
    monkeypatch.setenv("CONVEYOR_MEASURE_LINEARS", "0")
    llm = LLM(base, dtype="float32", num_threads=1, tensor_parallel_size=2,
              enable_lora=True, max_loras=3, max_num_batched_tokens=24)
    try:
        check(llm, base, adapters, n=8, max_tokens=8)
    finally:
        llm.shutdown()


def test_lora_over_quantized_projections_is_refused(base):
    """The delta adds to a float projection; over int8 weights it would be half-applied."""
    with pytest.raises(ValueError, match="quantized projections"):
        LLM(base, dtype="float32", enable_lora=True, quantization="int8")


def test_lora_on_a_mixture_of_experts_model_is_refused():
    from test_families import checkpoint

    with pytest.raises(ValueError, match="mixture-of-experts"):
        LLM(checkpoint("mixtral"), dtype="float32", enable_lora=True)
