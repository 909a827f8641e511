"""Few-row calls of a model's projections through conveyor's GEMM (``model/linear/few_rows.py``,
measured by ``model/autotune/few_rows.py``):
on bf16 weights its numbers are bf16 products summed in float32 and rounded once, calls
are split by row count, the split is taken only where measured no slower at every row
count it covers and faster by a margin at one, and never where the weights' second copy
would not fit; a float32 or bf16 engine with the split decodes as it does without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conveyor import LLM, SamplingParams
from conveyor.kernels import cpu as kernels
from conveyor.model.autotune import few_rows
from conveyor.model.autotune.few_rows import split_rows
from conveyor.model.dtypes import cpu_has_native_bf16
from conveyor.model.linear.few_rows import Bf16WeightGemm, RowSplitLinear
from conveyor.model.linear.native import native_gemm_lib
from conveyor.model.linear.shape import LinearShape

from helpers import make_checkpoint, random_prompts

needs_gemm = pytest.mark.skipif(kernels.load() is None or native_gemm_lib() is None,
                                reason="no native GEMM (kernels off, or no AVX2/FMA)")


@needs_gemm
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_the_gemm_sums_exact_bf16_products_in_float32_rounded_once(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(96, 200, generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(rows, 200, generator=g).to(torch.bfloat16)
    got = Bf16WeightGemm(w, None, native_gemm_lib())(x)
    assert got.dtype is torch.bfloat16 and got.shape == (rows, 96)
    exact = x.double() @ w.double().T  # the products are exact in float32 too
    torch.testing.assert_close(got.double(), exact, rtol=2 ** -8, atol=1e-6)
    assert (got == exact.to(torch.bfloat16)).float().mean() > 0.97  # rounded once
    # and the rows do not see each other
    torch.testing.assert_close(Bf16WeightGemm(w, None, native_gemm_lib())(x[:1]), got[:1],
                               rtol=0, atol=0)


class _Tag(nn.Module):
    in_features, out_features = 4, 3

    def __init__(self, tag: float) -> None:
        super().__init__()
        self.tag = tag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.full((x.shape[0], 3), self.tag)


def test_calls_are_split_by_row_count() -> None:
    split = RowSplitLinear(_Tag(1.0), _Tag(2.0), max_rows=2)
    assert [split(torch.zeros(n, 4))[0, 0].item() for n in (1, 2, 3, 64)] == [1, 1, 2, 2]
    fused = _Tag(2.0)
    fused.applies_silu_mul = True  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="plain projections on both sides"):
        RowSplitLinear(_Tag(1.0), fused, max_rows=2)


@pytest.mark.parametrize("times,rows", [
    ({1: (8, 10), 2: (9, 10), 4: (12, 10)}, 2),   # faster at 1 and 2, slower at 4
    ({1: (9.8, 10), 2: (8, 10), 4: (12, 10)}, 2),  # a margin at 2 only is enough
    ({1: (9.8, 10), 2: (9.9, 10), 4: (12, 10)}, 0),  # no better than WIN anywhere
    ({1: (12, 10), 2: (5, 10), 4: (5, 10)}, 0),   # slower at 1 row past a tie: no split
    ({1: (11, 10), 2: (5, 10), 4: (5, 10)}, 4),   # a tie at 1 row, won back after it
    ({1: (5, 10), 2: (5, 10), 4: (5, 10)}, 4),
    # float32 on a Zen 4: a tie at 4 rows, gains past it up to 64
    ({1: (6, 10), 2: (6.5, 10), 4: (10.5, 10), 8: (8, 10), 16: (8, 10), 32: (8.7, 10),
      64: (9.5, 10)}, 64),
    # ties past 2 rows that never win back: the split stops where the gain peaked
    ({1: (5, 10), 2: (5, 10), 4: (10.8, 10), 8: (10.8, 10)}, 2),
    ({1: (5, 10), 2: (5, 10), 4: (10.8, 10), 8: (11.5, 10), 16: (1, 10)}, 2),  # a loss ends it
])
def test_the_split_goes_where_the_gain_is_largest(times, rows: int) -> None:
    assert split_rows(times) == rows


def test_a_model_too_big_for_a_second_copy_is_not_split(monkeypatch) -> None:
    monkeypatch.delenv("CONVEYOR_FEW_ROWS", raising=False)
    counts = {LinearShape(3072, 576): 30, LinearShape(49152, 576, lm_head=True): 1}
    assert few_rows.extra_bytes(counts) == 2 * 3072 * 576 * 30  # not the LM head
    assert few_rows.extra_bytes(counts, 4) == 4 * 3072 * 576 * 30
    monkeypatch.setattr(few_rows, "MAX_EXTRA_BYTES", few_rows.extra_bytes(counts) - 1)
    assert few_rows.choose(counts, "onednn", None, None) == 0  # (nothing measured)
    monkeypatch.setenv("CONVEYOR_FEW_ROWS", "3")
    assert few_rows.choose(counts, "onednn", None, None) == 3  # forced


@needs_gemm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engine_with_the_split_gives_the_same_logits(monkeypatch, dtype: str) -> None:
    if dtype == "bfloat16" and not cpu_has_native_bf16():
        pytest.skip("bf16 arithmetic runs on F.linear only here (no AVX-512 BF16 or AMX): "
                    "no measured linear choice to split")
    path = make_checkpoint("llama")
    prompts = random_prompts(2, lo=5, hi=20, seed=4)
    logits = {}
    for forced in ("2", "0"):
        monkeypatch.setenv("CONVEYOR_FEW_ROWS", forced)
        llm = LLM(path, dtype=dtype, compute_dtype=dtype)
        runner = llm.engine.runner
        if runner.linear_backend.startswith("native"):
            pytest.skip("conveyor's GEMM is this CPU's choice already: nothing to split")
        split = [m for m in runner.model.modules() if isinstance(m, RowSplitLinear)]
        assert runner.few_rows == int(forced) and bool(split) == (forced == "2")
        runner.record_logits = True
        seen = []
        for i, p in enumerate(prompts):  # one at a time: every decode step has one row
            llm.engine.add_request({"prompt_token_ids": p},
                                   SamplingParams(max_tokens=4, temperature=0.0),
                                   request_id=str(i))
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
                seen += [v.clone() for v in runner.last_logits.values()]
        logits[forced] = torch.stack(seen)
    tol = 1e-4 if dtype == "float32" else 0.05
    torch.testing.assert_close(logits["2"], logits["0"], rtol=tol, atol=tol)
    assert F.cosine_similarity(logits["2"], logits["0"], dim=-1).min() > 0.999


def test_only_row_counts_below_the_timed_decode_rows_are_measured(monkeypatch,
                                                                  tmp_path) -> None:
    """Row counts the backend choice was timed at (a server's max_num_seqs) and above are
    its own: the split is measured below them, and not at all below 2 rows."""
    monkeypatch.delenv("CONVEYOR_FEW_ROWS", raising=False)
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path))
    seen = []

    def fake_measure(shapes, by_key, many, lib, dtype, row_counts):
        seen.append(row_counts)
        return {r: (5.0, 10.0) for r in row_counts}

    monkeypatch.setattr(few_rows, "measure", fake_measure)
    counts = {LinearShape(64, 32): 2}
    assert few_rows.choose(counts, "onednn", None, None, torch.float32, decode_rows=16) == 8
    assert seen == [(1, 2, 4, 8)]
    assert few_rows.choose(counts, "onednn", None, None, torch.float32, decode_rows=1) == 0
    assert len(seen) == 1
