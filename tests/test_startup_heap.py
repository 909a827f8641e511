"""An engine's start moves what it allocated out of the cyclic GC's generations
(``gc.freeze``): later full collections walk only what came after."""

from __future__ import annotations

import gc

import pytest

from conveyor import LLM


@pytest.mark.parametrize("switch", [None, "0"])
def test_an_engine_start_freezes_the_heap_unless_told_not_to(monkeypatch, switch) -> None:
    if switch is not None:
        monkeypatch.setenv("CONVEYOR_GC_FREEZE", switch)
    gc.unfreeze()  # whatever earlier tests froze
    try:
        LLM("tiny", load_format="dummy", dtype="float32")
        frozen = gc.get_freeze_count()
    finally:
        gc.unfreeze()
    if switch == "0":
        assert frozen == 0
    else:
        assert frozen > 10_000  # modules, the model, the engine: all of start-up
