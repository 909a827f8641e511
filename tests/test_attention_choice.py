"""``attention_backend="auto"`` chooses by measurement on this machine among the backends
that apply (and whether the winner's own prefill kernel beats SDPA), caches the choice,
and the engine stays exact whatever it picks."""

from __future__ import annotations

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.model.attention.registry import (
    attention_backend_names_for,
    select_attention_backend,
)
from conveyor.model.autotune import attention as attention_choice

from helpers import hf_greedy, make_checkpoint, random_prompts

CPU = torch.device("cpu")
HEADS = (4, 2, 16)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    return tmp_path


def fake_measure(fastest: str, calls: list, own_prefill_s: float = 0.0005):
    def measure(backends, *args):
        calls.append(1)
        return {n: {"decode": 0.001 if n == fastest else 0.002, "prefill": own_prefill_s,
                    "sdpa_prefill": 0.001} for n in backends}
    return measure


def test_the_fastest_is_chosen_and_cached(cache, monkeypatch) -> None:
    calls: list = []
    monkeypatch.setattr(attention_choice, "measure", fake_measure("b", calls))
    backends = dict.fromkeys(["a", "b"])
    assert attention_choice.choose(backends, CPU, torch.float32, *HEADS, 32) == ("b", True)
    assert attention_choice.choose(backends, CPU, torch.float32, *HEADS, 32) == ("b", True)
    assert len(calls) == 1, "the second engine reads the cache"
    attention_choice.choose(backends, CPU, torch.float32, *HEADS, 8)  # other rows
    attention_choice.choose(backends, CPU, torch.bfloat16, *HEADS, 32)  # other dtype
    assert len(calls) == 3
    assert (cache / "attention_choice.json").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_measurement_times_every_candidate(dtype) -> None:
    names = attention_backend_names_for(CPU, dtype, *HEADS)
    assert "sdpa" in names
    backends = {n: select_attention_backend(n, CPU, dtype, *HEADS) for n in names}
    timings = attention_choice.measure(backends, CPU, dtype, *HEADS, 3)
    assert set(timings) == set(names)
    assert all(t["decode"] > 0 and t["sdpa_prefill"] > 0 for t in timings.values())
    for name, backend in backends.items():  # a prefill kernel that takes the prompt is timed
        assert ("prefill" in timings[name]) == (backend.prefill_kernel() is not None)


@pytest.mark.skipif(len(attention_backend_names_for(CPU, torch.float32, *HEADS)) < 2,
                    reason="one attention backend only: nothing to choose")
@pytest.mark.parametrize("winner", ["native", "sdpa"])
def test_the_engine_runs_what_was_chosen_and_stays_exact(cache, monkeypatch, winner) -> None:
    calls: list = []
    monkeypatch.setattr(attention_choice, "measure", fake_measure(winner, calls))
    path = make_checkpoint("llama")
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    assert calls and llm.engine.runner.attention.name == winner
    prompts = random_prompts(3, seed=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=6, temperature=0.0))
    for out, prompt in zip(outs, prompts):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 6)


@pytest.mark.skipif("native" not in attention_backend_names_for(CPU, torch.float32, *HEADS),
                    reason="no native backend here")
def test_a_prefill_kernel_slower_than_sdpa_is_dropped_and_the_engine_stays_exact(
        cache, monkeypatch) -> None:
    """Its decode kernel wins, its prefill kernel loses (the portable C body on a CPU
    without AVX2): the backend runs with SDPA for prefill, cached as such."""
    calls: list = []
    monkeypatch.setattr(attention_choice, "measure",
                        fake_measure("native", calls, own_prefill_s=0.003))
    path = make_checkpoint("llama")
    llm = LLM(path, dtype="float32", num_kv_blocks=64)
    runner = llm.engine.runner
    assert runner.attention.name == "native" and runner.prefill_kernel is None
    prompts = random_prompts(3, seed=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=6, temperature=0.0))
    for out, prompt in zip(outs, prompts):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, 6)
    again = LLM(path, dtype="float32", num_kv_blocks=64)  # from the cache
    assert len(calls) == 1 and again.engine.runner.prefill_kernel is None


def test_a_forced_backend_or_the_switch_skips_the_measurement(cache, monkeypatch) -> None:
    calls: list = []
    monkeypatch.setattr(attention_choice, "measure", fake_measure("native", calls))
    assert LLM("tiny", load_format="dummy", num_kv_blocks=16,
               attention_backend="sdpa").engine.runner.attention.name == "sdpa"
    monkeypatch.setenv("CONVEYOR_MEASURE_ATTENTION", "0")
    LLM("tiny", load_format="dummy", num_kv_blocks=16)
    assert not calls
