"""The mixture-of-experts routing and combine kernel (kernels/cpu/moe_route.c) against
torch's ops as the block runs them (topk, renormalising, grouping by expert, index_add_),
bit for bit, in every build this CPU runs (native, AVX2, portable); and the block taking
it: the same bits as its torch routing, a tie at the k-th probability handed to torch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.kernels import cpu as kernels
from conveyor.kernels.cpu import moe_route
from conveyor.model.layers.moe import SparseMoE

BUILDS = [isa for isa in kernels.isa_builds() if isa != "amx-emulated"]


def build(isa: str):
    lib = moe_route.load_variant(isa)
    if lib is None:
        pytest.skip("no C compiler: the kernel does not build here")
    return lib


def torch_routing(probs: torch.Tensor, k: int, renormalize: bool, experts: int):
    """What the block's torch path computes: top-k, renormalised, grouped by expert."""
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    block = SparseMoE(8, 8, experts, k, renormalize)
    tokens, pair_weights, starts = block.group(weights, ids)
    return weights, ids, tokens, pair_weights, starts


@pytest.mark.parametrize("isa", BUILDS)
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, 40), experts=st.integers(1, 20), k=st.integers(1, 8),
       renormalize=st.booleans(), seed=st.integers(0, 2**16), scale=st.sampled_from(
           [0.1, 1.0, 30.0]))
def test_route_equals_torch_topk_and_grouping(isa, rows, experts, k, renormalize, seed,
                                              scale) -> None:
    k = min(k, experts)
    lib = build(isa)
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(rows, experts, generator=g) * scale, dim=-1)
    x = torch.randn(rows, 24, generator=g)[:, 2:21]  # rows 24 apart
    routed = moe_route.route(probs, x, k, renormalize, lib)
    if routed is None and renormalize and not moe_route.sums_as_torch(k, lib):
        return  # declined: torch's sum of k weights rounds otherwise
    if routed is None:  # declined: some row's k-th and (k+1)-th probabilities tie
        top = torch.topk(probs, min(k + 1, experts), dim=-1).values
        assert k < experts and bool((top[:, k - 1] == top[:, k]).any())
        return
    weights, ids, tokens, pair_weights, starts = torch_routing(probs, k, renormalize, experts)
    assert torch.equal(routed.top_weights, weights)
    assert torch.equal(routed.top_ids.long(), ids)
    assert torch.equal(routed.starts, starts)
    assert torch.equal(routed.tokens.long(), tokens)
    assert torch.equal(routed.pair_weights, pair_weights)
    assert torch.equal(routed.rows, x[tokens])


@pytest.mark.parametrize("isa", BUILDS)
def test_a_tie_at_the_kth_probability_or_a_nan_is_declined(isa) -> None:
    lib = build(isa)
    x = torch.randn(2, 8)
    tie = torch.tensor([[0.4, 0.1, 0.25, 0.15, 0.1], [0.5, 0.2, 0.1, 0.1, 0.1]])
    assert moe_route.route(tie, x, 2, False, lib) is not None  # ties below the top 2
    assert moe_route.route(tie, x, 3, False, lib) is None  # row 1's 3rd and 4th: 0.1, 0.1
    assert moe_route.route(tie, x, 4, False, lib) is None  # row 0's 4th and 5th
    nan = tie.clone()
    nan[1, 4] = float("nan")
    assert moe_route.route(nan, x, 2, False, lib) is None
    assert moe_route.route(tie, x, 5, False, lib) is not None  # k = E: no choice to make


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("rows,k", [(1, 1), (5, 2), (16, 4), (33, 3)])
def test_combine_equals_index_add_in_pair_order(isa, rows, k) -> None:
    lib = build(isa)
    torch.manual_seed(rows * 10 + k)
    probs = torch.softmax(torch.randn(rows, 7), dim=-1)
    routed = moe_route.route(probs, torch.randn(rows, 40), k, True, lib)
    h = torch.randn(rows * k, 48)[:, :40]  # rows 48 apart
    want = torch.zeros(rows, 40)
    want.index_add_(0, routed.tokens.long(), h * routed.pair_weights[:, None])
    assert torch.equal(moe_route.combine(h, routed, lib), want)


def _native_block(renormalize: bool, experts: int = 6, top_k: int = 3) -> SparseMoE:
    from conveyor.model.linear.native import NativeLinear, native_gemm_lib

    lib = native_gemm_lib()
    if lib is None or moe_route.load() is None:
        pytest.skip("no AVX2 + FMA GEMM or no C compiler here")
    block = SparseMoE(64, 40, experts, top_k, renormalize)
    for expert in block.experts:
        expert.gate_up_proj = NativeLinear(torch.randn(80, 64) * 0.1, None, lib, gate_up=True)
        expert.down_proj = NativeLinear(torch.randn(64, 40) * 0.1, None, lib)
    return block


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("batch", [1, 4, 16, 70])
def test_block_routes_natively_with_torch_routings_bits(renormalize: bool, batch: int) -> None:
    """Experts on conveyor's GEMM: the block routes and combines natively (both routing
    variants), and every output is the bits of its torch routing and combine."""
    torch.manual_seed(batch)
    block = _native_block(renormalize)
    x = torch.randn(batch, 64)
    native = block.forward_native(x)
    if renormalize and not moe_route.sums_as_torch(3, moe_route.load()):
        pytest.skip("torch's sum of 3 weights rounds otherwise here: torch renormalises")
    assert native is not None
    assert torch.equal(block(x), native)
    block.forward_native = lambda x: None  # an instance attribute shadows the method
    assert torch.equal(native, block(x))


def test_block_hands_a_tie_to_torch_topk() -> None:
    """Router rows tied at the k-th probability (all-zero router weights: every
    probability equal): the native routing declines, and the block's output is its torch
    path's."""
    torch.manual_seed(0)
    block = _native_block(True)
    with torch.no_grad():
        block.gate.weight.zero_()
    x = torch.randn(5, 64)
    assert block.forward_native(x) is None
    out = block(x)
    block.forward_native = lambda x: None
    assert torch.equal(out, block(x))


def test_block_renormalises_with_torch_where_its_sum_rounds_otherwise(monkeypatch) -> None:
    """Where torch's sum of k weights would round otherwise than the kernel's
    left-to-right one, the block renormalises with torch: the same bits."""
    torch.manual_seed(2)
    block = _native_block(True)
    monkeypatch.setattr(moe_route, "sums_as_torch", lambda k, lib: False)
    x = torch.randn(9, 64)
    assert block.forward_native(x) is None
    out = block(x)
    block.forward_native = lambda x: None
    assert torch.equal(out, block(x))


@pytest.mark.parametrize("starts", [[0, 3, 2, 5], [0, 2, 3, 4], [1, 2, 3, 5], [0, 2, 3]])
def test_grouped_gemm_refuses_starts_that_do_not_rise_from_0_to_the_rows(starts) -> None:
    """The grouped GEMM hands ``starts`` to C as row bounds: falling, not ending at x's
    rows, not starting at 0 or one short are refused before any pointer is passed."""
    block = _native_block(True, experts=3, top_k=1)
    gate_up, _ = block.grouped_gemms()
    x = torch.randn(5, 64)
    assert gate_up(x, torch.tensor([0, 2, 2, 5], dtype=torch.int32)).shape == (5, 40)
    with pytest.raises(ValueError, match="starts int32"):
        gate_up(x, torch.tensor(starts, dtype=torch.int32))


@pytest.mark.parametrize("isa", BUILDS)
def test_two_weights_renormalise_as_torch_in_every_build(isa) -> None:
    """Two weights have one sum (a + b): the kernel must renormalise them as torch does
    wherever it builds (Mixtral's top-2), so the block never needs torch's ops for it."""
    assert moe_route.sums_as_torch(2, build(isa))
