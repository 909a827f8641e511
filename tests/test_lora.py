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
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
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
