"""``linear_backend="auto"`` chooses per weight shape by measurement on this machine, caches
the choice, and packs each projection with it; outputs stay exact whatever it picks."""

from __future__ import annotations

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.model import linear_choice
from conveyor.model.backends import linear_backend_names_for, select_linear_backend
from conveyor.model.linear_choice import LinearShape

CPU = torch.device("cpu")
SHAPES = [LinearShape(8, 4), LinearShape(12, 4, gate_up=True), LinearShape(30, 4, lm_head=True)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    return tmp_path


def fake_timings(fastest: dict[str, str]):
    calls = []

    def measure(shapes, backends, *args):
        calls.append(1)
        return {s.key: {n: (0.001 if fastest[s.key] == n else 0.002) for n in backends}
                for s in shapes}

    return measure, calls


def test_the_fastest_per_shape_is_chosen_and_cached(cache, monkeypatch) -> None:
    names = ["a", "b"]
    fastest = {SHAPES[0].key: "b", SHAPES[1].key: "a", SHAPES[2].key: "b"}
    measure, calls = fake_timings(fastest)
    monkeypatch.setattr(linear_choice, "measure", measure)
    backends = dict.fromkeys(names)
    assert linear_choice.choose(SHAPES, backends, CPU, torch.float32, 32, 512) == fastest
    assert linear_choice.choose(SHAPES, backends, CPU, torch.float32, 32, 512) == fastest
    assert len(calls) == 1, "the second engine reads the cache"
    linear_choice.choose(SHAPES, backends, CPU, torch.float32, 64, 512)  # other rows
    assert len(calls) == 2
    assert (cache / "linear_choice.json").exists()


def test_real_measurement_times_every_candidate() -> None:
    names = linear_backend_names_for(CPU, torch.float32)
    backends = {n: select_linear_backend(n, CPU, torch.float32) for n in names}
    timings = linear_choice.measure(SHAPES, backends, CPU, torch.float32, 3, 7)
    assert set(timings) == {s.key for s in SHAPES}
    assert all(set(t) == set(names) and min(t.values()) > 0 for t in timings.values())


@pytest.mark.skipif(len(linear_backend_names_for(CPU, torch.float32)) < 2,
                    reason="one linear backend only: nothing to choose")
def test_the_engine_packs_each_shape_as_chosen_and_stays_exact(cache, monkeypatch) -> None:
    names = linear_backend_names_for(CPU, torch.float32)
    # Force a mixed choice: the first candidate for some shapes, torch for the rest.
    def measure(shapes, backends, *args):
        return {s.key: {n: (0.001 if n == (names[0] if i % 2 else "torch") else 0.002)
                        for n in backends} for i, s in enumerate(shapes)}

    monkeypatch.setattr(linear_choice, "measure", measure)
    prompts = [{"prompt_token_ids": [5, 9, 11, 3 + i]} for i in range(3)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    mixed = LLM("tiny", load_format="dummy", dtype="float32")
    runner = mixed.engine.runner
    assert len(set(runner.linear_choice.values())) == 2
    plain = LLM("tiny", load_format="dummy", dtype="float32", linear_backend="torch")
    assert plain.engine.runner.linear_choice == {}
    got = [o.outputs[0].token_ids for o in mixed.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params)]


def test_measuring_can_be_turned_off(cache, monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_MEASURE_LINEARS", "0")
    monkeypatch.setattr(linear_choice, "measure", lambda *a: pytest.fail("measured"))
    llm = LLM("tiny", load_format="dummy", dtype="float32")
    assert llm.engine.runner.linear_choice == {}
