"""The start-up choice at the fused decode step's rows: projections timed as the step calls
them (``autotune/fused_calls.py``, one native loop) decide the one-row backend among those
the step calls; the LM head and backends the step cannot call keep the modules' timing."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.model.linear.shape import LinearShape

CPU = torch.device("cpu")


def test_the_one_row_winner_is_the_fastest_as_the_step_calls_it(monkeypatch, tmp_path):
    from conveyor.model.autotune import cache, fused_calls, linears, row_ranges

    monkeypatch.setattr(cache, "_path", lambda kind: str(tmp_path / f"{kind}.json"))
    shapes = [LinearShape(64, 32), LinearShape(128, 32, gate_up=True),
              LinearShape(96, 32, lm_head=True)]
    backends = {"a": object(), "b": object(), "c": object()}

    def through_modules(shapes, backends, device, dtype, decode_rows, prefill_rows,
                        counts=None):  # a fastest everywhere, c slowest
        return {s.key: {n: ({"a": 1.0, "b": 2.0, "c": 3.0}[n],) * 2 for n in backends}
                for s in shapes}

    native_calls = []

    def as_the_step_calls(shapes, backends, dtype, rows, counts=None):
        # b ahead of a; c is not one the step calls; no LM head here
        native_calls.append((rows, sorted(backends)))
        return {s.key: {"a": 2.0, "b": 1.0} for s in shapes if not s.lm_head}

    monkeypatch.setattr(linears, "measure", through_modules)
    monkeypatch.setattr(fused_calls, "measure", as_the_step_calls)
    got = row_ranges.choose(shapes, backends, CPU, torch.float32, 1, 1)
    for s in shapes[:2]:
        assert got[s.key] == row_ranges.RowRanges("b", 1, "a"), s.key
    assert got[shapes[2].key] == row_ranges.RowRanges("a", 0, "a")  # (the head: modules)
    assert native_calls == [(1, ["a", "b", "c"]), (1, ["a", "b"])]
    # cached: the same choice without measuring again
    monkeypatch.setattr(fused_calls, "measure", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.setattr(linears, "measure", lambda *a, **k: pytest.fail("measured"))
    assert row_ranges.choose(shapes, backends, CPU, torch.float32, 1, 1) == got


def test_a_winner_the_step_cannot_call_keeps_the_modules_choice(monkeypatch, tmp_path):
    from conveyor.model.autotune import cache, fused_calls, linears, row_ranges

    monkeypatch.setattr(cache, "_path", lambda kind: str(tmp_path / f"{kind}.json"))
    shapes = [LinearShape(64, 32)]
    monkeypatch.setattr(linears, "measure", lambda shapes, backends, *a, **k: {
        s.key: {n: ({"a": 2.0, "b": 3.0, "c": 1.0}[n],) * 2 for n in backends}
        for s in shapes})
    monkeypatch.setattr(fused_calls, "measure", lambda shapes, backends, *a, **k: {
        s.key: {"a": 2.0, "b": 1.0} for s in shapes})
    got = row_ranges.choose(shapes, {"a": 0, "b": 0, "c": 0}, CPU, torch.float32, 1, 1)
    assert got[shapes[0].key] == row_ranges.RowRanges("c", 0, "c")


def test_native_timing_of_the_int8_kernels():
    """The real loop: the int8 kernels the step calls get a time for every projection
    shape (not the head); the dequantising backend none; with one callable backend left
    there is nothing to choose between."""
    from conveyor.kernels.cpu import quant
    from conveyor.model.autotune import fused_calls
    from conveyor.model.quant.backends import Scheme, quant_linear_backends

    if not quant.simd():
        pytest.skip("no AVX2 build of the quantized kernel")
    shapes = [LinearShape(96, 64), LinearShape(224, 64, gate_up=True), LinearShape(64, 112),
              LinearShape(384, 64, lm_head=True)]
    backends = {n: quant_linear_backends.get(n)(CPU, torch.float32, Scheme(8))
                for n in ("native-int", "native-int8-a16", "dequant")}
    counts = {s.key: 3 for s in shapes}
    for rows in (1, 3):
        got = fused_calls.measure(shapes, backends, torch.float32, rows, counts)
        assert got is not None and set(got) == {s.key for s in shapes[:3]}
        for times in got.values():
            assert set(times) == {"native-int", "native-int8-a16"}
            assert all(0 < t < math.inf for t in times.values())
    two = {n: backends[n] for n in ("native-int", "dequant")}
    assert fused_calls.measure(shapes, two, torch.float32, 1, counts) is None


def test_the_split_stays_below_the_decode_rows(monkeypatch, tmp_path):
    """The server's decode rows are the larger calls' winner's (timed there): the one-row
    winner takes calls below them only, however far it wins past them."""
    from conveyor.model.autotune import cache, fused_calls, linears, row_ranges

    monkeypatch.setattr(cache, "_path", lambda kind: str(tmp_path / f"{kind}.json"))
    shapes = [LinearShape(64, 32)]

    def times(shapes, backends, device, dtype, decode_rows, prefill_rows, counts=None):
        # b wins at one row and at every split count, a wins the decode + prefill choice
        one = decode_rows == 1 or decode_rows == prefill_rows
        return {s.key: {n: ((1.0 if (n == "b") == one else 2.0),) * 2 for n in backends}
                for s in shapes}

    monkeypatch.setattr(linears, "measure", times)
    monkeypatch.setattr(fused_calls, "measure", lambda *a, **k: None)
    got = row_ranges.choose(shapes, {"a": 0, "b": 0}, CPU, torch.float32, 8, 512)
    assert got[shapes[0].key] == row_ranges.RowRanges("b", 4, "a")
