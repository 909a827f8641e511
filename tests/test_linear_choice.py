"""``linear_backend="auto"`` chooses per weight shape by measurement on this machine, caches
the choice, and packs each projection with it; outputs stay exact whatever it picks."""

from __future__ import annotations

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.model.autotune import linears as linear_choice
from conveyor.model.linear.registry import linear_backend_names_for, select_linear_backend
from conveyor.model.linear.shape import LinearShape

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
        return {s.key: {n: (0.001, 0.001) if fastest[s.key] == n else (0.002, 0.002)
                         for n in backends}
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
    assert all(set(t) == set(names) and min(min(v) for v in t.values()) > 0
               for t in timings.values())


@pytest.mark.skipif(len(linear_backend_names_for(CPU, torch.float32)) < 2,
                    reason="one linear backend only: nothing to choose")
def test_the_engine_packs_each_shape_as_chosen_and_stays_exact(cache, monkeypatch) -> None:
    names = linear_backend_names_for(CPU, torch.float32)
    # Force a mixed choice: the first candidate for some shapes, torch for the rest.
    def measure(shapes, backends, *args):
        return {s.key: {n: (0.001, 0.001) if n == (names[0] if i % 2 else "torch")
                        else (0.002, 0.002) for n in backends} for i, s in enumerate(shapes)}

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


def test_the_rotation_runs_each_shape_as_often_as_the_model_has_it_up_to_a_byte_cap() -> None:
    layer = [LinearShape(8, 4), LinearShape(12, 4, gate_up=True)]
    head = LinearShape(30, 4, lm_head=True)
    counts = {layer[0].key: 3, layer[1].key: 3, head.key: 1}
    order = linear_choice.rotation([*layer, head], counts, itemsize=4)
    assert order == [*layer, head, *layer, *layer], "layer after layer, the head once"
    # Capped by bytes (1-byte items): the first round 8*4 + 12*4 + 30*4 = 200, then 80.
    assert linear_choice.rotation([*layer, head], counts, 1, cap=250) == [*layer, head, *layer]
    assert linear_choice.rotation([*layer, head], counts, 1, cap=1) == [*layer, head], (
        "at least one round")
    assert linear_choice.rotation(layer, None, 4) == layer


def test_decode_rows_are_timed_on_a_weight_of_its_own_per_call_in_layer_order() -> None:
    """Each call of the decode measurement reads a weight no call before it in that pass
    read (as a decode step reads each projection once): the same weight timed back to back
    is a cached one, which is not what a decode step sees."""
    seen: list[tuple[int, int]] = []  # (weight storage, rows) of each call

    class Recording(torch.nn.Module):
        def __init__(self, weight: torch.Tensor) -> None:
            super().__init__()
            self.weight = weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append((self.weight.data_ptr(), x.shape[0]))
            return x @ self.weight.T

    class Backend:
        def make_linear(self, weight, bias, gate_up=False):
            return Recording(weight)

    layer = [LinearShape(8, 4), LinearShape(6, 4)]
    counts = {s.key: 4 for s in layer}
    timings = linear_choice.measure(layer, {"rec": Backend()}, CPU, torch.float32, 3, 7,
                                    counts)
    decode = [ptr for ptr, rows in seen if rows == 3]
    per_pass = len(layer) * 4
    per_round = per_pass * (linear_choice.ROTATION_PASSES + 1)
    assert len(decode) == per_round * linear_choice.MEASURE_ROUNDS
    for r in range(0, len(decode), per_round):  # each round packs its own copies
        turn = decode[r:r + per_round]
        first = turn[:per_pass]
        assert len(set(first)) == per_pass, "every call of a pass on a weight of its own"
        assert all(turn[i:i + per_pass] == first for i in range(0, per_round, per_pass))
    assert any(rows == 7 for _, rows in seen), "and a prefill-sized call"
    assert all(d > 0 and p > 0 for t in timings.values() for d, p in t.values())


def test_backends_take_turns_and_keep_their_best_round(monkeypatch) -> None:
    """Every backend is timed once a round, in reversed order every other round, and keeps
    its best: a slow turn (a burst of load on a shared machine) does not decide alone."""
    turns: list[str] = []
    # scripted seconds per turn: "a" slow in its first turn only
    script = {"a": iter([5.0, 0.5]), "b": iter([1.0, 1.0])}

    class Backend:
        def __init__(self, name: str) -> None:
            self.name = name

        def make_linear(self, weight, bias, gate_up=False):
            def run(x):
                return x @ weight.T
            run.backend = self.name
            return run

    def fake_times(calls, xs):
        name = calls[0][1].backend
        turns.append(name)
        t = next(script[name])
        return {key: t for key, _ in calls}

    monkeypatch.setattr(linear_choice, "_rotation_times", fake_times)
    monkeypatch.setattr(linear_choice.choice_cache, "best_of", lambda fn: 1.0)
    layer = [LinearShape(8, 4)]
    timings = linear_choice.measure(layer, {"a": Backend("a"), "b": Backend("b")}, CPU,
                                    torch.float32, 3, 7)
    assert linear_choice.MEASURE_ROUNDS == 2
    assert turns == ["a", "b", "b", "a"]
    assert timings["8x4"] == {"a": (0.5, 1.0), "b": (1.0, 1.0)}
    assert linear_choice.fastest(timings["8x4"]) == "a"


def test_decode_and_prefill_count_alike_as_ratios() -> None:
    """A backend 7% faster at 512 prefill rows but 40% slower at decode rows loses, though
    its summed seconds are fewer (the prefill call is ~20x the decode call's)."""
    times = {"a": (0.140, 2.000), "b": (0.100, 2.140)}
    assert sum(times["a"]) < sum(times["b"])
    assert linear_choice.fastest(times) == "b"
    assert linear_choice.fastest({"a": (0.1, 1.0), "b": (0.1, 1.1)}) == "a"
