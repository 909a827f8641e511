"""The fused prompt-logprobs row kernel (kernels/cpu/logprob_rows.c) against torch's
passes and float64 log-softmax, in every build this CPU runs (native, AVX2, portable)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.kernels import cpu as kernels
from conveyor.kernels.cpu import logprob_rows
from conveyor.runner.prompt_logprobs import (
    PromptSpan,
    _row_kernel,
    compute_prompt_logprobs,
    reduce_rows_torch,
)

BUILDS = [isa for isa in kernels.isa_builds() if isa != "amx-emulated"]


def build(isa: str):
    lib = logprob_rows.load_variant(isa)
    if lib is None:
        pytest.skip("no C compiler: the kernel does not build here")
    return lib


def tolerance(logprobs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Both sides compute x - max - log(sum) in float32, in different orders (torch may
    round x - (max + log(sum))): a few ulps of the largest operand (the row's largest
    |logit|, |result|, log(sum)), plus log(sum)'s error, the sums differing in order
    (each term's relative error ~ a few ulps: a few epsilons). 8 epsilons of that scale
    (at least 8 epsilons) between the two float32 computations."""
    eps = torch.finfo(torch.float32).eps
    rows = logits.double()
    log_sum = torch.logsumexp(rows, -1) - rows.amax(-1)
    per_row = (rows.abs().amax(-1) + log_sum).float().reshape(-1, *[1] * (logprobs.dim() - 1))
    return 8 * eps * (logprobs.abs() + per_row).clamp(min=1.0)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("vocab", [7, 512, 1000, 4099, 49152])
def test_kernel_equals_torch_passes(isa: str, vocab: int) -> None:
    lib = build(isa)
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(37, vocab, generator=gen) * 4
    targets = torch.randint(0, vocab, (37,), generator=gen)
    for k in sorted({0, 1, 2, 5, min(20, vocab)}):
        lp, rank, ids, vals = logprob_rows.reduce_rows(logits, targets, k, lib)
        t_lp, t_rank, t_ids, t_vals = reduce_rows_torch(logits, targets, k)
        assert torch.equal(rank, t_rank)
        assert torch.equal(ids, t_ids)
        assert ((lp - t_lp).abs() <= tolerance(t_lp, logits)).all()
        assert ((vals - t_vals).abs() <= tolerance(t_vals, logits)).all()
        exact = torch.log_softmax(logits.double(), dim=-1)
        assert ((lp.double() - exact.gather(1, targets[:, None])[:, 0]).abs()
                <= tolerance(t_lp, logits).double()).all()


@pytest.mark.parametrize("isa", BUILDS)
def test_a_strided_slice_of_rows(isa: str) -> None:
    """Rows with a leading stride wider than the vocabulary (a view of wider logits)."""
    lib = build(isa)
    wide = torch.randn(9, 300, generator=torch.Generator().manual_seed(1))
    logits = wide[:, :260]
    targets = torch.arange(9) * 20
    got = logprob_rows.reduce_rows(logits, targets, 3, lib)
    want = reduce_rows_torch(logits.contiguous(), targets, 3)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert torch.allclose(got[0], want[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("isa", BUILDS)
def test_bf16_rows_give_what_their_float32_upcast_gives(isa: str) -> None:
    lib = build(isa)
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(21, 3001, generator=gen) * 4).to(torch.bfloat16)  # many ties
    targets = torch.randint(0, 3001, (21,), generator=gen)
    for k in (0, 1, 7):
        got = logprob_rows.reduce_rows(logits, targets, k, lib)
        want = logprob_rows.reduce_rows(logits.float(), targets, k, lib)
        # Ids and ranks exact; the sums may vectorise differently per element type.
        assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
        assert ((got[0] - want[0]).abs() <= tolerance(want[0], logits.float())).all()
        assert ((got[3] - want[3]).abs() <= tolerance(want[3], logits.float())).all()
    assert torch.equal(got[1], reduce_rows_torch(logits.float(), targets, 7)[1])


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_ties_rank_by_strictly_greater_and_top_k_lower_id_first(data) -> None:
    lib = build(BUILDS[0])
    vocab = data.draw(st.integers(1, 40))
    values = data.draw(st.lists(st.sampled_from([-3.0, -1.0, 0.0, 0.5, 2.0]),
                                min_size=vocab, max_size=vocab))
    target = data.draw(st.integers(0, vocab - 1))
    k = data.draw(st.integers(0, min(vocab, 8)))
    row = torch.tensor([values])
    lp, rank, ids, vals = logprob_rows.reduce_rows(row, torch.tensor([target]), k, lib)
    assert rank.item() == 1 + sum(v > values[target] for v in values)
    assert ids[0].tolist() == sorted(range(vocab), key=lambda i: (-values[i], i))[:k]
    exact = torch.log_softmax(row.double(), dim=-1)[0]
    assert abs(lp.item() - exact[target].item()) <= 1e-6
    assert torch.allclose(vals[0].double(), exact[ids[0]], atol=1e-6, rtol=0)


def test_bad_arguments_are_refused() -> None:
    lib = build(BUILDS[0])
    logits = torch.zeros(2, 10)
    with pytest.raises(ValueError, match="refused"):
        logprob_rows.reduce_rows(logits, torch.tensor([3, 10]), 1, lib)
    with pytest.raises(ValueError, match="k must be"):
        logprob_rows.reduce_rows(logits, torch.tensor([3, 4]), 11, lib)
    with pytest.raises(ValueError, match="float32"):
        logprob_rows.reduce_rows(logits.double(), torch.tensor([3, 4]), 1, lib)
    with pytest.raises(ValueError, match="int64"):
        logprob_rows.reduce_rows(logits, torch.tensor([3, 4], dtype=torch.int32), 1, lib)


def test_prompt_logprobs_take_the_kernel_and_agree_with_torch() -> None:
    build(BUILDS[0])
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(300, 16, generator=gen)
    head = torch.randn(1000, 16, generator=gen)
    spans = [PromptSpan("a", 0, 1, torch.randint(0, 1000, (200,), generator=gen).tolist(), 5),
             PromptSpan("b", 210, 3, torch.randint(0, 1000, (80,), generator=gen).tolist(), 0)]
    calls = []

    def logits(h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        return h @ head.T

    fused = compute_prompt_logprobs(hidden, spans, logits, slice_rows=64)
    plain = compute_prompt_logprobs(hidden, spans, logits, slice_rows=64, use_kernel=False)
    assert max(calls) <= 64
    for rid in ("a", "b"):
        assert fused[rid][0] == plain[rid][0]
        for (i1, v1, r1, lp1), (i2, v2, r2, lp2) in zip(fused[rid][1], plain[rid][1]):
            assert i1 == i2 and r1 == r2
            assert v1 == pytest.approx(v2, abs=1e-5) and lp1 == pytest.approx(lp2, abs=1e-5)


def test_native_kernels_off_takes_the_torch_path(monkeypatch) -> None:
    assert _row_kernel(torch.device("cpu"), 5) is not None or logprob_rows.load() is None
    monkeypatch.setenv("CONVEYOR_NATIVE_KERNELS", "0")
    assert logprob_rows.load() is None
    assert _row_kernel(torch.device("cpu"), 5) is None
    # Beyond the kernel's k: torch too.
    monkeypatch.delenv("CONVEYOR_NATIVE_KERNELS")
    lib = logprob_rows.load()
    if lib is not None:
        assert _row_kernel(torch.device("cpu"), logprob_rows.max_k(lib) + 1) is None
