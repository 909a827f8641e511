"""Pre-packed linears (oneDNN and conveyor's native GEMM): the same products as F.linear,
the fused SwiGLU of the native gate/up projection, the LM head included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conveyor.model.packed_linear import (
    NativeLinear,
    PackedLinear,
    native_gemm_lib,
    onednn_available,
    pack_linears,
    pick_linear_backend,
)

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
needs_native = pytest.mark.skipif(native_gemm_lib() is None,
                                  reason="no AVX2/FMA or no C compiler for the native GEMM")


def _as_accurate_as_torch(got: torch.Tensor, torch_fp32: torch.Tensor,
                          exact: torch.Tensor) -> None:
    """fp32 sums in another order round differently: ``got`` must be within a small
    multiple of torch's own float32 error against the float64 result."""
    assert got.shape == exact.shape and got.dtype == torch.float32
    ours = (got.double() - exact).abs().max().item()
    theirs = (torch_fp32.double() - exact).abs().max().item()
    assert ours <= 4 * theirs + 1e-6, (ours, theirs)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 40, generator=gen)
    torch.testing.assert_close(PackedLinear(w, b)(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


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
    exact = F.linear(x.double(), w.double(), b.double() if bias else None)
    _as_accurate_as_torch(NativeLinear(w, b, native_gemm_lib())(x), F.linear(x, w, b), exact)


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
    gu, gu64 = F.linear(x, w), F.linear(x.double(), w.double())
    _as_accurate_as_torch(got, F.silu(gu[:, :inter]) * gu[:, inter:],
                          F.silu(gu64[:, :inter]) * gu64[:, inter:])


@needs_native
def test_native_linear_reads_strided_rows_and_keeps_leading_dims() -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(24, 16, generator=gen)
    lin = NativeLinear(w, None, native_gemm_lib())
    base = torch.randn(10, 40, generator=gen)
    x = base[:, 4:20]  # rows 40 floats apart
    _as_accurate_as_torch(lin(x), F.linear(x, w), F.linear(x.double(), w.double()))
    x3 = torch.randn(2, 5, 16, generator=gen)
    _as_accurate_as_torch(lin(x3), F.linear(x3, w), F.linear(x3.double(), w.double()))
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
    assert pick_linear_backend("auto", cpu, torch.bfloat16) == "torch"
    assert pick_linear_backend("auto", torch.device("cuda"), torch.float32) == "torch"
    expected = ("native" if native_gemm_lib() is not None
                else "onednn" if onednn_available() else "torch")
    assert pick_linear_backend("auto", cpu, torch.float32) == expected
    with pytest.raises(ValueError, match="needs a float32 model on CPU"):
        pick_linear_backend("onednn", cpu, torch.bfloat16)
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
