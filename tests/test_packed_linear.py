"""Pre-packed linears (oneDNN and conveyor's native GEMM): the same products as F.linear,
the fused SwiGLU of the native gate/up projection, the LM head included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels import cpu as kernels
from conveyor.kernels.cpu import ops
from conveyor.model.dtypes import cpu_has_native_bf16
from conveyor.model.linear.native import NativeLinear, native_gemm_lib
from conveyor.model.linear.onednn import PackedLinear, onednn_available
from conveyor.model.linear.packing import pack_linears
from conveyor.model.linear.registry import pick_linear_backend

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
needs_native = pytest.mark.skipif(native_gemm_lib() is None,
                                  reason="no AVX2/FMA or no C compiler for the native GEMM")


EPS32 = 2.0 ** -24  # float32's unit roundoff


def _dot_error_bound(x: torch.Tensor, w: torch.Tensor,
                     b: torch.Tensor | None = None) -> torch.Tensor:
    """Elementwise worst-case error of ``x @ w.T + b`` summed in float32 in any order (FMA,
    blocked, split K): ``|fl(s) - s| <= (K + 1) * eps * sum |x_i w_i|`` (Higham, Accuracy and
    Stability, 3.1), plus one rounding for the bias. It depends only on the operands, never on
    how accurate torch's own kernel happens to be on this CPU."""
    k = x.shape[-1]
    mag = x.double().abs() @ w.double().abs().T
    if b is not None:
        mag = mag + b.double().abs()
    return (k + 2) * EPS32 * mag


def _within(got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> None:
    assert got.shape == exact.shape and got.dtype == torch.float32
    err = (got.double() - exact).abs()
    assert torch.isfinite(got).all()
    excess = (err - bound).max().item()
    assert excess <= 0, f"max error over the bound by {excess:.3g}"


def _as_exact_as_fp32_allows(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                             b: torch.Tensor | None = None) -> None:
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    _within(got, exact, _dot_error_bound(x, w, b))


@needs_onednn
@pytest.mark.skipif(not cpu_has_native_bf16(), reason="the CPU has no native bf16")
@pytest.mark.parametrize("rows", [1, 32, 300])
def test_packed_bf16_linear_matches_f_linear(rows: int) -> None:
    """oneDNN's packed bf16 GEMM accumulates in fp32 and rounds once, as F.linear's."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 200, generator=gen).to(torch.bfloat16)
    b = torch.randn(96, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 200, generator=gen).to(torch.bfloat16)
    got = PackedLinear(w, b)(x)
    assert got.dtype is torch.bfloat16
    exact = F.linear(x.double(), w.double(), b.double())
    # One bf16 rounding of an fp32-accumulated dot product: 2^-8 relative, plus the sum's.
    err = (got.double() - exact).abs()
    bound = exact.abs() * 2.0 ** -8 + _dot_error_bound(x.float(), w.float(), b.float())
    assert (err <= bound).all(), float((err - bound).max())


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 40, generator=gen)
    _as_exact_as_fp32_allows(PackedLinear(w, b)(x), x, w, b)


# Rows around the kernel's 6-row tiles and 144-row blocks; shapes with partial 16-column
# panels, one K block (K <= 288) and several (the last one short).
@needs_native
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 32, 145, 300])
@pytest.mark.parametrize("n,k", [(96, 40), (17, 300), (576, 576), (50, 1100)])
@pytest.mark.parametrize("bias", [False, True])
def test_native_linear_matches_f_linear(rows: int, n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(rows, k, generator=gen)
    _as_exact_as_fp32_allows(NativeLinear(w, b, native_gemm_lib())(x), x, w, b)


@needs_native
@pytest.mark.parametrize("rows", [1, 6, 7, 145])
@pytest.mark.parametrize("inter,k", [(48, 40), (25, 300), (288, 576), (9, 1100)])
def test_native_gate_up_applies_silu_mul(rows: int, inter: int, k: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + inter)
    w = torch.randn(2 * inter, k, generator=gen)
    x = torch.randn(rows, k, generator=gen) * 4  # gate values well below -80 occur
    lin = NativeLinear(w, None, native_gemm_lib(), gate_up=True)
    got = lin(x)
    assert lin.applies_silu_mul and got.shape == (rows, inter)
    assert torch.isfinite(got).all()
    gu64 = F.linear(x.double(), w.double())
    g, u = gu64[:, :inter], gu64[:, inter:]
    bound = _dot_error_bound(x, w)
    dg, du = bound[:, :inter], bound[:, inter:]
    silu = F.silu(g)
    # Propagated: |silu'| <= 1.1, so the gate's error moves silu by at most 1.1 * dg. Then
    # the epilogue's own roundings (exp within a few ulp, the division, the product): 32 eps
    # relative; and silu of a gate clamped below -80 is off by at most 1e-30 absolute.
    propagated = 1.1 * dg * (u.abs() + du) + silu.abs() * du
    _within(got, silu * u, propagated + 32 * EPS32 * (silu * u).abs() + 1e-30)


@needs_native
def test_native_linear_reads_strided_rows_and_keeps_leading_dims() -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(24, 16, generator=gen)
    lin = NativeLinear(w, None, native_gemm_lib())
    base = torch.randn(10, 40, generator=gen)
    x = base[:, 4:20]  # rows 40 floats apart
    _as_exact_as_fp32_allows(lin(x), x, w)
    # The tiles read x in place: a short 6-row sliver (5 rows; 6 + 5) of strided rows
    # gives the bits its contiguous copy gives.
    for rows in (5, 11):
        assert torch.equal(lin(x[:rows]), lin(x[:rows].contiguous())), rows
    x3 = torch.randn(2, 5, 16, generator=gen)
    _as_exact_as_fp32_allows(lin(x3), x3, w)
    assert lin(torch.empty(0, 16)).shape == (0, 24)


@needs_onednn
def test_pack_linears_replaces_every_linear_and_keeps_the_function() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Sequential(nn.Linear(16, 4)))
    x = torch.randn(5, 8)
    want = model(x)
    assert pack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), want, atol=1e-6, rtol=1e-5)


def test_backend_choice() -> None:
    cpu = torch.device("cpu")
    assert pick_linear_backend("torch", cpu, torch.float32) == "torch"
    bf16_packs = onednn_available() and cpu_has_native_bf16()
    assert pick_linear_backend("auto", cpu, torch.bfloat16) == (
        "onednn" if bf16_packs else "torch")
    assert pick_linear_backend("auto", torch.device("cuda"), torch.float32) == "torch"
    expected = ("native" if native_gemm_lib() is not None
                else "onednn" if onednn_available() else "torch")
    assert pick_linear_backend("auto", cpu, torch.float32) == expected
    if not bf16_packs:
        with pytest.raises(ValueError, match=r"needs a float32 model \(or bfloat16"):
            pick_linear_backend("onednn", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="needs a float32 model"):
        pick_linear_backend("onednn", cpu, torch.float16)
    with pytest.raises(ValueError, match="needs a float32 model on a CPU with AVX2"):
        pick_linear_backend("native", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        pick_linear_backend("mkl", cpu, torch.float32)


@pytest.mark.parametrize("backend", [
    pytest.param("onednn", marks=needs_onednn), pytest.param("native", marks=needs_native)])
def test_engine_packs_the_model_and_its_tied_head(backend: str) -> None:
    from conveyor import LLM, SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 11, 3 + i]} for i in range(3)]
    packed = LLM("tiny", load_format="dummy", dtype="float32", linear_backend=backend)
    plain = LLM("tiny", load_format="dummy", dtype="float32", linear_backend="torch")
    assert packed.engine.runner.linear_backend == backend
    assert packed.engine.runner.packed_linears and not plain.engine.runner.packed_linears
    model = packed.engine.runner.model
    assert model.packed_lm_head is not None
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    fused = [layer.mlp.gate_up_proj.applies_silu_mul for layer in model.layers
             if isinstance(layer.mlp.gate_up_proj, NativeLinear)]
    assert fused == ([True] * len(model.layers) if backend == "native" else [])
    got = [o.outputs[0].token_ids for o in packed.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert got == want


# --- bf16 weights read by the native GEMM (float32 arithmetic) ---------------------------

@needs_native
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 32, 145])
@pytest.mark.parametrize("n,k,gate_up,bias", [
    (96, 40, False, True), (17, 300, False, False), (576, 576, True, False),
    (50, 1100, False, True), (18, 700, True, False)])
def test_bf16_weight_linear_is_the_float32_kernel_bit_for_bit(rows, n, k, gate_up,
                                                              bias) -> None:
    """A bf16 checkpoint computed in float32: the weight kept as bf16 and widened as the
    kernel loads it gives exactly what the float32 kernel gives on the widened weight, at
    every row count (the few-row tiles, the 6-row ones, the widened panel copies)."""
    gen = torch.Generator().manual_seed(rows * 7 + n)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16).float()  # bf16 values
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(rows, k, generator=gen)
    lib = native_gemm_lib()
    narrow = NativeLinear(w, b, lib, gate_up=gate_up, bf16_weight=True)
    wide = NativeLinear(w, b, lib, gate_up=gate_up)
    assert narrow.packed.dtype is torch.bfloat16 and wide.packed.dtype is torch.float32
    assert narrow.packed.numel() == wide.packed.numel()  # half the bytes
    assert torch.equal(narrow(x), wide(x))
    if not gate_up:
        _as_exact_as_fp32_allows(narrow(x), x, w, b)


@needs_native
@pytest.mark.parametrize("bf16_weight", [False, True])
@pytest.mark.parametrize("n,k,gate_up", [(96, 40, False), (100, 1100, False),
                                         (576, 300, True)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(bf16_weight, n, k,
                                                             gate_up) -> None:
    """Decode rows go through tiles of 1-4 rows over several panels, larger batches
    through 6-row tiles: each output must be the same sum in the same order either way,
    or a request's logits (and a greedy tie, a seeded sample) would depend on its batch."""
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16).float()
    lin = NativeLinear(w, None, native_gemm_lib(), gate_up=gate_up, bf16_weight=bf16_weight)
    x = torch.randn(40, k, generator=gen)
    full = lin(x)
    for rows in (1, 2, 3, 4, 5, 6, 7, 13):
        assert torch.equal(lin(x[:rows]), full[:rows]), rows
    assert torch.equal(lin(x[17:18]), full[17:18])


def _gemm_builds() -> list[str]:
    """The capped builds of the kernels this CPU runs that have the GEMM (AVX2 and up)."""
    return [isa for isa in kernels.isa_builds() if isa != "portable"]


@needs_native
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,gate_up,bias", [(96, 40, False, True), (50, 700, False, False),
                                              (576, 300, True, False)])
def test_every_gemm_body_gives_the_same_bits(weight_dtype, n, k, gate_up, bias) -> None:
    """The AVX-512 body (a 16-column panel row in one zmm) runs each output's FMAs in the
    AVX2 body's order, so a model's numbers do not depend on which of them the CPU got:
    every build this machine runs, at decode row counts, 6-row tiles with a short last
    sliver, and several K blocks, against the AVX2 build."""
    builds = _gemm_builds()
    if "avx2" not in builds or len(builds) < 2:
        pytest.skip("this CPU runs one GEMM body only")
    gen = torch.Generator().manual_seed(n * 3 + k)
    w = torch.randn(n, k, generator=gen).to(weight_dtype).contiguous()
    b = torch.randn(n, generator=gen) if bias else None
    packed = ops.gemm_pack_weight(w, gate_up)
    x = torch.randn(40, k, generator=gen)
    ref_lib = kernels.load_variant("avx2")
    for rows in (1, 2, 3, 4, 5, 8, 9, 14, 40):
        ref = ops.gemm(x[:rows], packed, b, n, k, gate_up, lib=ref_lib)
        for isa in builds:
            out = ops.gemm(x[:rows], packed, b, n, k, gate_up, lib=kernels.load_variant(isa))
            assert torch.equal(out, ref), (isa, rows)


@needs_native
def test_bf16_weight_linear_refuses_a_weight_it_would_round() -> None:
    w = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))  # not bf16 values
    with pytest.raises(ValueError, match="would be rounded"):
        NativeLinear(w, None, native_gemm_lib(), bf16_weight=True)
    lin = NativeLinear(w.to(torch.bfloat16), None, native_gemm_lib(), bf16_weight=True)
    assert lin.packed.dtype is torch.bfloat16 and "bf16 weight" in repr(lin)


@needs_native
def test_native_bf16_applies_to_bf16_checkpoints_computed_in_float32_only() -> None:
    cpu = torch.device("cpu")
    assert pick_linear_backend("native-bf16", cpu, torch.float32,
                               torch.bfloat16) == "native-bf16"
    for dtype, weight_dtype in ((torch.float32, None), (torch.bfloat16, None),
                                (torch.float32, torch.float16)):
        with pytest.raises(ValueError, match="needs a bfloat16 checkpoint computed in "
                           "float32"):
            pick_linear_backend("native-bf16", cpu, dtype, weight_dtype)
    # auto without measurement: the static order keeps native first
    assert pick_linear_backend("auto", cpu, torch.float32, torch.bfloat16) == "native"


@needs_native
def test_engine_with_bf16_weights_computes_what_native_does() -> None:
    from conveyor import LLM, SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 11, 3 + i] * (1 + i)} for i in range(5)]
    common = dict(load_format="dummy", dtype="bfloat16", compute_dtype="float32")
    narrow = LLM("tiny", linear_backend="native-bf16", **common)
    wide = LLM("tiny", linear_backend="native", **common)
    model = narrow.engine.runner.model
    packed = [m for m in model.modules() if isinstance(m, NativeLinear)]
    assert packed and all(m.packed.dtype is torch.bfloat16 for m in packed)
    assert narrow.engine.runner.linear_backend == "native-bf16"
    got = [o.outputs[0].token_ids for o in narrow.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in wide.generate(prompts, params)]
    assert got == want
    # a float32 checkpoint has no bf16 weights to read
    with pytest.raises(ValueError, match="needs a bfloat16 checkpoint"):
        LLM("tiny", load_format="dummy", dtype="float32", linear_backend="native-bf16")
