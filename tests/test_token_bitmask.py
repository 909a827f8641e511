"""The packed token bitmask applied to logits (kernels/cpu/token_bitmask.py): the native
kernel and the numpy fallback ban exactly the tokens whose bit is clear, in the named
rows only, and refuse bad arguments."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.kernels.cpu.token_bitmask import apply_token_bitmask, load


def reference(logits: torch.Tensor, mask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    words = mask.numpy().view(np.uint32)
    for r, row in enumerate(rows):
        for t in range(logits.shape[1]):
            j, i = divmod(t, 32)
            if j >= words.shape[1] or not (int(words[r, j]) >> i) & 1:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("native", [True, False])
@settings(max_examples=40, deadline=None)
@given(data=st.data(), vocab=st.integers(1, 100), n=st.integers(1, 5))
def test_only_the_allowed_tokens_of_the_named_rows_survive(native: bool, data, vocab: int,
                                                           n: int) -> None:
    if native and load() is None:
        pytest.skip("native kernels unavailable")
    rows = data.draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
    words = data.draw(st.integers(max(1, (vocab + 31) // 32 - 1), (vocab + 31) // 32 + 1))
    # Each word: all ones, all zeros or random bits (the kernel's three paths).
    raw = data.draw(st.lists(st.sampled_from([-1, 0, None]), min_size=len(rows) * words,
                             max_size=len(rows) * words))
    rand = np.random.default_rng(len(raw)).integers(-2**31, 2**31, len(raw))
    mask = torch.tensor([int(rand[k]) if w is None else w for k, w in enumerate(raw)],
                        dtype=torch.int32).view(len(rows), words)
    logits = torch.randn(n, vocab)
    want = reference(logits, mask, rows)
    got = apply_token_bitmask(logits.clone(), mask, torch.tensor(rows, dtype=torch.int64),
                              native=native)
    assert torch.equal(got, want)


def test_bad_arguments_are_refused() -> None:
    logits, mask = torch.zeros(2, 40), torch.zeros(1, 2, dtype=torch.int32)
    rows = torch.tensor([0])
    with pytest.raises(ValueError, match="rows must lie"):
        apply_token_bitmask(logits, mask, torch.tensor([2]))
    with pytest.raises(ValueError, match="float32"):
        apply_token_bitmask(logits.double(), mask, rows)
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(logits, mask.long(), rows)
    with pytest.raises(ValueError, match="one per mask row"):
        apply_token_bitmask(logits, mask, torch.tensor([0, 1]))
