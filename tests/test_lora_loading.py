"""Adapters are loaded ahead of their requests, off the step's path (core/lora_loads.py,
model/lora/manager.py): while an adapter is read, its requests wait and the others keep
stepping; tokens still equal PEFT's; a failed load fails that adapter's requests only."""

from __future__ import annotations

import threading

import pytest
from lora_helpers import make_adapter, peft_greedy

from conveyor import LoRARequest, SamplingParams
from conveyor.config import EngineArgs
from conveyor.core.lora_loads import LORA_LOAD_FAILED
from conveyor.engine.llm_engine import LLMEngine
from conveyor.model.lora import manager

from helpers import make_checkpoint, random_prompts

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base() -> str:
    return make_checkpoint("llama")


@pytest.fixture(scope="module")
def adapters(base: str) -> list[LoRARequest]:
    return [LoRARequest(f"a{i}", i, make_adapter(base, i, r=8)) for i in (1, 2)]


class SlowLoader:
    """``load_adapter`` held until ``release``; records the thread each load ran on."""

    def __init__(self, fail: set[str] = frozenset()) -> None:
        self.gate = threading.Event()
        self.threads: list[str] = []
        self.fail = fail
        self.real = manager.load_adapter

    def __call__(self, request, *args, **kwargs):
        self.threads.append(threading.current_thread().name)
        self.gate.wait(timeout=20)
        if request.lora_name in self.fail:
            raise ValueError(f"corrupt tensors in {request.lora_name}")
        return self.real(request, *args, **kwargs)


def engine(base: str, **kwargs) -> LLMEngine:
    return LLMEngine(EngineArgs(model=base, dtype="float32", enable_lora=True, max_loras=2,
                                max_lora_rank=8, **kwargs))


def run(eng: LLMEngine, max_steps: int = 500) -> dict[str, object]:
    done = {}
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            break
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_other_requests_step_while_an_adapter_loads(base, adapters, monkeypatch):
    slow = SlowLoader()
    monkeypatch.setattr(manager, "load_adapter", slow)
    eng = engine(base)
    prompts = random_prompts(3, lo=5, hi=20, seed=7)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    loras = [None, adapters[0], adapters[1]]
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        eng.add_request(prompt, params, request_id=f"r{i}", lora_request=lora)
    done = run(eng, max_steps=30)  # the loads are held: only the base request can finish
    assert set(done) == {"r0"}, done
    assert len(done["r0"].outputs[0].token_ids) == 6
    assert {r.request_id for r in eng.scheduler.running} == set()
    assert slow.threads and all(t.startswith("conveyor-lora") for t in slow.threads)
    slow.gate.set()
    done |= run(eng)
    assert set(done) == {"r0", "r1", "r2"}
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        want = peft_greedy(base, lora.lora_path if lora else None, tuple(prompt), 6)
        assert done[f"r{i}"].outputs[0].token_ids == want, i
    assert eng.runner.lora.step_loads == 0  # no adapter was read on a step's path
    assert eng.stats()["lora"] == {"resident": 2, "loading": 0, "loads_ordered": 2}


def test_a_failed_load_fails_its_requests_only(base, adapters, monkeypatch):
    slow = SlowLoader(fail={"a2"})
    slow.gate.set()
    monkeypatch.setattr(manager, "load_adapter", slow)
    eng = engine(base)
    prompts = random_prompts(4, lo=5, hi=20, seed=8)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    loras = [None, adapters[0], adapters[1], adapters[1]]
    for i, (prompt, lora) in enumerate(zip(prompts, loras)):
        eng.add_request(prompt, params, request_id=f"r{i}", lora_request=lora)
    done = run(eng)
    for i in (2, 3):
        out = done[f"r{i}"].outputs[0]
        assert out.finish_reason == "abort" and out.token_ids == []
        assert out.stop_reason.startswith(f"{LORA_LOAD_FAILED}: ValueError: corrupt"), out
    for i in (0, 1):
        want = peft_greedy(base, loras[i].lora_path if loras[i] else None,
                           tuple(prompts[i]), 5)
        assert done[f"r{i}"].outputs[0].token_ids == want, i
    # a later request of the adapter orders it again (the failure may have passed)
    slow.fail = set()
    eng.add_request(prompts[2], params, request_id="again", lora_request=adapters[1])
    done = run(eng)
    assert done["again"].outputs[0].token_ids == peft_greedy(
        base, adapters[1].lora_path, tuple(prompts[2]), 5)
