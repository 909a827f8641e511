"""The bf16 elementwise kernels (``kernels/elementwise.c``) of every build this CPU runs
(its own, and capped at AVX-512 without BF16, at AVX2 and at portable C: the bodies
other CPUs get) against the reference, ``TorchOps`` on bf16 tensors, on rows whose
length leaves a tail after the vectors: the rounded residual add and RoPE bit for bit,
RMSNorm and SiLU-and-mul within a rounding of it (their sums may add in another order)."""

from __future__ import annotations

import pytest
import torch

from conveyor.kernels import cpu as kernels
from conveyor.model.layers.norm import RMSNorm
from conveyor.model.layers.ops import TorchOps
from conveyor.model.layers.rotary import RotaryEmbedding

BF = torch.bfloat16
pytestmark = pytest.mark.skipif(kernels.load() is None,
                                reason="native kernels unavailable " + kernels.why_unavailable())


def _check_rounding_away(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype is BF and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-3)
    assert (got == want).float().mean() > 0.95


@pytest.mark.parametrize("isa", kernels.isa_builds())
@pytest.mark.parametrize("dim", [100, 576])
def test_bf16_norms_and_silu_track_the_reference(isa: str, dim: int) -> None:
    lib = kernels.load_variant(isa)
    g = torch.Generator().manual_seed(dim)
    ref, rows = TorchOps(), 37
    norm = RMSNorm(dim, 1e-5)
    norm.weight.data = (1 + 0.3 * torch.randn(dim, generator=g)).to(BF)
    w = norm.weight.data
    x = (3 * torch.randn(rows, dim, generator=g)).to(BF)
    out = torch.empty_like(x)
    lib.rms_norm_bf16(x.data_ptr(), w.data_ptr(), out.data_ptr(), rows, dim, norm.eps)
    _check_rounding_away(out, ref.rms_norm(x, norm))

    res = torch.randn(rows, dim, generator=g).to(BF)
    want_out, want_res = ref.add_rms_norm(x, res.clone(), norm)
    lib.add_rms_norm_bf16(x.data_ptr(), res.data_ptr(), w.data_ptr(), out.data_ptr(), rows,
                          dim, norm.eps)
    assert torch.equal(res, want_res)  # one rounded add per element
    _check_rounding_away(out, want_out)

    gate_up = (2 * torch.randn(rows, 2 * dim, generator=g)).to(BF)
    act = torch.empty(rows, dim, dtype=BF)
    lib.silu_mul_bf16(gate_up.data_ptr(), act.data_ptr(), rows, dim)
    _check_rounding_away(act, ref.silu_mul(gate_up, dim))


@pytest.mark.parametrize("isa", kernels.isa_builds())
@pytest.mark.parametrize("head_dim", [20, 64, 128])
def test_bf16_rope_is_the_reference_bit_for_bit(isa: str, head_dim: int) -> None:
    lib = kernels.load_variant(isa)
    g = torch.Generator().manual_seed(head_dim)
    heads, kv_heads, t = 5, 2, 11
    rope = RotaryEmbedding({"rope_theta": 10000.0}, head_dim, 512)
    positions = torch.randint(0, 512, (t,), generator=g)
    qkv = (2 * torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g)).to(BF)
    want_q, want_k, want_v = TorchOps().rope_(rope, positions, qkv.clone(), heads, kv_heads,
                                              head_dim)
    lib.rope_bf16(qkv.data_ptr(), positions.data_ptr(), rope.cos.data_ptr(),
                  rope.sin.data_ptr(), t, heads + kv_heads, qkv.stride(0), head_dim)
    got = qkv.view(t, heads + 2 * kv_heads, head_dim)
    assert torch.equal(got[:, :heads], want_q)
    assert torch.equal(got[:, heads:heads + kv_heads], want_k)
    assert torch.equal(got[:, heads + kv_heads:], want_v)
