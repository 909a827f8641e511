"""The checked entry points to the native kernels (``kernels/ops.py``, also registered as
``torch.ops.conveyor.*``): each refuses a wrong dtype, a non-contiguous tensor, a tensor
on another device and a wrong shape with a ValueError naming the op and the argument (in
the test process: a crash would take it down), and gives the reference results on good
input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.kernels import cpu as kernels
from conveyor.kernels.cpu import ops
from conveyor.model.attention.metadata import AttentionMetadata
from conveyor.model.attention.native_decode import NativeDecode
from conveyor.model.attention.native_prefill import NativePrefill
from conveyor.model.attention.sdpa import sdpa_decode

native = pytest.mark.skipif(kernels.load() is None,
                            reason="native kernels unavailable " + kernels.why_unavailable())
needs_gemm = pytest.mark.skipif(kernels.load() is None or not ops.gemm_available(),
                                reason="no native GEMM (kernels off, or no AVX2/FMA)")


def _rms_case():
    gen = torch.Generator().manual_seed(0)
    return dict(x=torch.randn(5, 48, generator=gen), weight=torch.randn(48, generator=gen),
                eps=1e-5)


def _add_rms_case():
    gen = torch.Generator().manual_seed(1)
    return dict(x=torch.randn(5, 48, generator=gen), residual=torch.randn(5, 48, generator=gen),
                weight=torch.randn(48, generator=gen), eps=1e-5)


def _silu_case():
    return dict(gate_up=torch.randn(7, 80, generator=torch.Generator().manual_seed(2)),
                intermediate=40)


def _rope_tables(max_pos: int = 64, d: int = 16):
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(max_pos).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rope_case():
    cos, sin = _rope_tables()
    qkv = torch.randn(7, (4 + 2 * 2) * 16, generator=torch.Generator().manual_seed(3))
    return dict(qkv=qkv, positions=torch.tensor([0, 3, 9, 63, 1, 2, 40]), cos=cos, sin=sin,
                heads=6, head_dim=16)


def _decode_case(dtype=torch.float32):
    gen = torch.Generator().manual_seed(4)
    b, hq, hkv, d, num_slots = 3, 8, 2, 16, 64
    lens = torch.tensor([5, 17, 1], dtype=torch.int32)
    slots = torch.zeros(b, int(lens.max()), dtype=torch.int64)
    perm = torch.randperm(num_slots, generator=gen)
    for i, n in enumerate(lens.tolist()):
        slots[i, :n] = perm[i * 20:i * 20 + n]
    return dict(q=torch.randn(b, hq, d, generator=gen),
                k_cache=torch.randn(num_slots, hkv, d, generator=gen).to(dtype),
                v_cache=torch.randn(num_slots, hkv, d, generator=gen).to(dtype),
                slots=slots, lens=lens, starts=torch.zeros(b, dtype=torch.int32), scale=0.25)


def _qkv_views(t: int = 9, hq: int = 4, hkv: int = 2, d: int = 32):
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(5))
    return (qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d),
            qkv[:, (hq + hkv) * d:].view(t, hkv, d))


def _prefill_case():
    q, k, v = _qkv_views()
    return dict(q=q, k=k, v=v, out=torch.empty(q.shape), scale=0.2)


def _gemm_case(bias: bool = True):
    gen = torch.Generator().manual_seed(6)
    w = torch.randn(40, 24, generator=gen)
    return dict(x=torch.randn(7, 24, generator=gen), packed=ops.gemm_pack_weight(w),
                bias=torch.randn(40, generator=gen) if bias else None, out_features=40,
                in_features=24, gate_up=False), w


CASES = {  # op: (arguments builder, tensors to spoil)
    "rms_norm": (_rms_case, ("x", "weight")),
    "add_rms_norm_": (_add_rms_case, ("x", "residual", "weight")),
    "silu_mul": (_silu_case, ("gate_up",)),
    "rope_": (_rope_case, ("qkv", "positions", "cos", "sin")),
    "decode_attention": (_decode_case, ("q", "k_cache", "v_cache", "slots", "lens", "starts")),
    "prefill_attention": (_prefill_case, ("q", "k", "v", "out")),
    "gemm": (lambda: _gemm_case()[0], ("x", "packed", "bias")),
    "gemm_pack_weight": (lambda: dict(weight=torch.randn(40, 24), gate_up=False), ("weight",)),
}


def _other_dtype(t: torch.Tensor) -> torch.Tensor:
    return t.to({torch.int64: torch.int32, torch.int32: torch.int64}.get(t.dtype,
                                                                         torch.float64))


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values, every other element of a twice-as-wide buffer (last dim stride 2)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


SPOILERS = {
    "dtype": _other_dtype,
    "strides": _strided,
    "device": lambda t: t.to("meta"),
    "ndim": lambda t: t.unsqueeze(0),
}
CALLS = {"python": lambda op: getattr(ops, op),
         "torch.ops": lambda op: getattr(torch.ops.conveyor, op)}


@native
@pytest.mark.parametrize("via", list(CALLS))
@pytest.mark.parametrize("spoil", list(SPOILERS))
@pytest.mark.parametrize("op", list(CASES))
def test_each_op_refuses_a_bad_tensor_with_a_clear_error(op: str, spoil: str, via: str) -> None:
    build, names = CASES[op]
    fn = CALLS[via](op)
    for name in names:
        args = build()
        args[name] = SPOILERS[spoil](args[name])
        with pytest.raises(ValueError, match=rf"conveyor::{op}: {name} must"):
            fn(**args)


_cos, _sin = _rope_tables()
BAD_SHAPES = [  # (op, arguments changed from the good case, what the error says)
    ("rms_norm", lambda: dict(weight=torch.randn(47)), "elements"),
    ("add_rms_norm_", lambda: dict(residual=torch.randn(4, 48)), "disagree"),
    ("silu_mul", lambda: dict(intermediate=41), "columns"),
    ("rope_", lambda: dict(positions=torch.arange(6)), "do not fit"),
    ("rope_", lambda: dict(heads=9), "do not fit"),  # more heads than a row has
    ("rope_", lambda: dict(cos=_cos[:, :8].contiguous(), sin=_sin[:, :8].contiguous()),
     "do not fit"),
    ("decode_attention", lambda: dict(lens=torch.zeros(2, dtype=torch.int32)), "do not fit"),
    ("decode_attention", lambda: dict(q=torch.randn(3, 7, 16)), "do not fit"),  # 7 q, 2 KV
    ("decode_attention", lambda: dict(v_cache=torch.randn(63, 2, 16)), "do not fit"),
    ("decode_attention", lambda: dict(q=torch.randn(3, 8, 8)), "do not fit"),
    ("decode_attention", lambda: dict(slots=torch.zeros(2, 17, dtype=torch.int64)),
     "do not fit"),
    ("prefill_attention", lambda: dict(out=torch.empty(8, 4, 32)), "do not fit"),
    ("prefill_attention", lambda: dict(k=_qkv_views()[1].contiguous()),
     "do not fit"),  # k and v row strides differ
    ("prefill_attention",
     lambda: dict(q=_qkv_views()[0].transpose(1, 2).contiguous().transpose(1, 2)),
     "heads contiguous"),
    ("gemm", lambda: dict(in_features=25), "do not fit"),
    ("gemm", lambda: dict(bias=torch.randn(39)), "do not fit"),
    ("gemm", lambda: dict(packed=torch.zeros(ops.gemm_packed_size(40, 24) + 1)[1:]),
     "alignment"),  # contiguous, 4 bytes off
    ("gemm", lambda: dict(packed=ops.gemm_pack_weight(torch.randn(32, 24))), "do not fit"),
    ("gemm", lambda: dict(out_features=41), "do not fit"),  # the bias is for 40
    ("gemm", lambda: dict(out_features=0), "out of range"),
]


@native
@pytest.mark.parametrize("via", list(CALLS))
@pytest.mark.parametrize("op, changes, says", BAD_SHAPES,
                         ids=[f"{op}-{i}" for i, (op, _, _) in enumerate(BAD_SHAPES)])
def test_each_op_refuses_a_wrong_shape(op: str, changes, says: str, via: str) -> None:
    if op.startswith("gemm") and not ops.gemm_available():
        pytest.skip("no native GEMM")
    args = CASES[op][0]()
    args.update(changes())
    with pytest.raises(ValueError, match=rf"conveyor::{op}: .*{says}"):
        CALLS[via](op)(**args)


@native
def test_non_tensors_are_refused() -> None:
    with pytest.raises(ValueError, match="conveyor::rms_norm: x must be a tensor, got list"):
        ops.rms_norm([[1.0]], torch.ones(1), 1e-5)
    with pytest.raises(ValueError, match="conveyor::gemm: bias must be a tensor"):
        ops.gemm(_gemm_case()[0]["x"], _gemm_case()[0]["packed"], 3.0, 40, 24)


def test_without_the_kernels_a_good_call_says_they_are_unavailable(monkeypatch) -> None:
    monkeypatch.setattr(ops, "_lib", None)
    monkeypatch.setattr(kernels, "load", lambda: None)
    with pytest.raises(RuntimeError, match="native kernels are unavailable"):
        ops.rms_norm(**_rms_case())
    with pytest.raises(ValueError, match="x must be float32"):  # the checks come first
        ops.rms_norm(torch.ones(2, 2, dtype=torch.float64), torch.ones(2), 1e-5)


# --- good input: the reference results --------------------------------------------------

def _ref_rms(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@native
@pytest.mark.parametrize("via", list(CALLS))
def test_elementwise_ops_match_torch(via: str) -> None:
    call = CALLS[via]
    args = _rms_case()
    torch.testing.assert_close(call("rms_norm")(**args), _ref_rms(**args))
    args = _add_rms_case()
    residual = args["residual"].clone()
    got = call("add_rms_norm_")(**args)
    torch.testing.assert_close(args["residual"], residual + args["x"])  # in place
    torch.testing.assert_close(got, _ref_rms(residual + args["x"], args["weight"], 1e-5))
    args = _silu_case()
    gate, up = args["gate_up"].split(40, dim=-1)
    torch.testing.assert_close(call("silu_mul")(**args), F.silu(gate) * up)


def _ref_rope(x, positions, cos, sin):
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    half = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s


@native
@pytest.mark.parametrize("via", list(CALLS))
@pytest.mark.parametrize("strided_rows", [False, True])
def test_rope_matches_torch(via: str, strided_rows: bool) -> None:
    args = _rope_case()
    if strided_rows:  # rows of a wider buffer: the kernel takes the row stride
        wide = torch.full((7, 200), 7.0)
        wide[:, :128] = args["qkv"]
        args["qkv"] = wide[:, :128]
    heads = args["qkv"].clone().view(7, 8, 16)
    want = _ref_rope(heads[:, :6], args["positions"], args["cos"], args["sin"])
    assert CALLS[via]("rope_")(**args) is None
    got = args["qkv"].reshape(7, 8, 16)
    torch.testing.assert_close(got[:, :6], want)
    torch.testing.assert_close(got[:, 6:], heads[:, 6:])  # v untouched
    if strided_rows:
        assert (wide[:, 128:] == 7.0).all()


@native
@pytest.mark.parametrize("via", list(CALLS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_matches_sdpa(via: str, dtype: torch.dtype) -> None:
    args = _decode_case(dtype)
    cols = torch.arange(args["slots"].shape[1])
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=3,
                             decode_slots=args["slots"], decode_lens=args["lens"],
                             decode_starts=args["starts"],
                             decode_mask=cols[None, :] < args["lens"][:, None])
    want = sdpa_decode(args["q"], args["k_cache"].float(),
                       args["v_cache"].float(), meta, args["scale"])
    got = CALLS[via]("decode_attention")(**args)
    tol = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    if dtype == torch.float32:
        torch.testing.assert_close(NativeDecode(kernels.load())(args["q"], args["k_cache"],
                                                                args["v_cache"], meta, 0.25),
                                   got, atol=0, rtol=0)


@native
@pytest.mark.parametrize("via", list(CALLS))
def test_prefill_attention_matches_causal_sdpa(via: str) -> None:
    args = _prefill_case()
    q, k, v = args["q"], args["k"], args["v"]
    # The reference in float64: torch's own float32 SDPA rounds differently on each CPU.
    want = F.scaled_dot_product_attention(
        q.double().transpose(0, 1).unsqueeze(0), k.double().transpose(0, 1).unsqueeze(0),
        v.double().transpose(0, 1).unsqueeze(0), is_causal=True, scale=0.2,
        enable_gqa=True)[0]
    assert CALLS[via]("prefill_attention")(**args) is True
    torch.testing.assert_close(args["out"].double(), want.transpose(0, 1), atol=2e-6,
                               rtol=1e-5)
    q, k, v = _qkv_views(d=48)  # no compiled copy for head dim 48: declined, not an error
    assert CALLS[via]("prefill_attention")(q, k, v, torch.empty(q.shape), 0.1) is False


@native
def test_the_wrappers_still_decline_or_refuse() -> None:
    prefill = NativePrefill(kernels.load())
    q, k, v = _qkv_views()
    assert not prefill(q.double(), k.double(), v.double(), torch.empty(q.shape), 0.1)
    with pytest.raises(ValueError, match="conveyor::prefill_attention: out must be a CPU"):
        prefill(q, k, v, torch.empty(q.shape, device="meta"), 0.1)
    args = _decode_case()
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=3,
                             decode_slots=args["slots"], decode_lens=args["lens"].long(),
                             decode_starts=args["starts"])
    with pytest.raises(ValueError, match="conveyor::decode_attention: lens must be int32"):
        NativeDecode(kernels.load())(args["q"], args["k_cache"], args["v_cache"], meta, 0.25)
    with pytest.raises(ValueError, match="k_cache must be float32 or bfloat16, got float16"):
        NativeDecode(kernels.load())(args["q"], args["k_cache"].half(),
                                     args["v_cache"].half(), meta, 0.25)


@needs_gemm
@pytest.mark.parametrize("via", list(CALLS))
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_matches_f_linear(via: str, bias: bool) -> None:
    args, w = _gemm_case(bias)
    want = F.linear(args["x"].double(), w.double(),
                    None if args["bias"] is None else args["bias"].double())
    got = CALLS[via]("gemm")(**args)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    packed = CALLS[via]("gemm_pack_weight")(w, False)
    assert torch.equal(packed, args["packed"])
    gemm = ops.PackedGemm(w, args["bias"])
    torch.testing.assert_close(gemm(args["x"]), got, atol=0, rtol=0)
    assert gemm(torch.empty(0, 24)).shape == (0, 40)
    base = torch.zeros(7, 50)
    base[:, 10:34] = args["x"]
    torch.testing.assert_close(gemm(base[:, 10:34]), got, atol=0, rtol=0)  # strided rows


@needs_gemm
def test_packed_gemm_checks_its_input_and_its_operands_once() -> None:
    _, w = _gemm_case()
    gemm = ops.PackedGemm(w, torch.randn(40))
    for bad, name in ((torch.randn(7, 24).double(), "x must be float32"),
                      (torch.randn(7, 24, device="meta"), "x must be a CPU"),
                      (torch.randn(24, 7).t(), "x must have unit stride"),
                      (torch.randn(7, 25), "do not fit"), (torch.randn(24), "x must have 2")):
        with pytest.raises(ValueError, match=f"conveyor::gemm: .*{name}"):
            gemm(bad)
    with pytest.raises(ValueError, match="bias has 39 elements for 40 outputs"):
        ops.PackedGemm(w, torch.randn(39))
    with pytest.raises(ValueError, match="gate/up projection takes no bias"):
        ops.PackedGemm(w, torch.randn(40), gate_up=True)
    with pytest.raises(ValueError, match="gate/up weight needs an even row count"):
        ops.PackedGemm(torch.randn(41, 24), gate_up=True)
    gu = ops.PackedGemm(w, gate_up=True)
    x = torch.randn(3, 24)
    g, u = F.linear(x, w).split(20, dim=-1)
    torch.testing.assert_close(gu(x), F.silu(g) * u, atol=1e-4, rtol=1e-4)


@native
@pytest.mark.parametrize("via", list(CALLS))
def test_bf16_elementwise_ops_track_the_torch_reference(via: str) -> None:
    """bf16 in, bf16 out, fp32 inside, rounded where ``TorchOps`` on bf16 tensors rounds:
    nearly every element equal to the reference's, the rest one rounding away."""
    from conveyor.model.layers.norm import RMSNorm
    from conveyor.model.layers.ops import TorchOps
    from conveyor.model.layers.rotary import RotaryEmbedding

    call, ref = CALLS[via], TorchOps()
    g = torch.Generator().manual_seed(3)
    bf = torch.bfloat16
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = (1 + 0.3 * torch.randn(96, generator=g)).to(bf)

    def check(got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.dtype is bf and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-3)
        assert (got == want).float().mean() > 0.9  # the same roundings, not just close

    x = (3 * torch.randn(33, 96, generator=g)).to(bf)
    check(call("rms_norm")(x, norm.weight, norm.eps), ref.rms_norm(x, norm))
    res = torch.randn(33, 96, generator=g).to(bf)
    want_out, want_res = ref.add_rms_norm(x, res.clone(), norm)
    got_res = res.clone()
    check(call("add_rms_norm_")(x, got_res, norm.weight, norm.eps), want_out)
    assert torch.equal(got_res, want_res)  # one rounded add: bit for bit
    gate_up = (2 * torch.randn(33, 2 * 40, generator=g)).to(bf)
    check(call("silu_mul")(gate_up, 40), ref.silu_mul(gate_up, 40))
    rope = RotaryEmbedding({"rope_theta": 10000.0}, 16, 64)
    positions = torch.randint(0, 64, (9,), generator=g)
    qkv = torch.randn(9, (4 + 2 * 2) * 16, generator=g).to(bf)
    want_q, want_k, want_v = ref.rope_(rope, positions, qkv.clone(), 4, 2, 16)
    got = qkv.clone()
    assert call("rope_")(got, positions, rope.cos, rope.sin, 6, 16) is None
    heads = got.view(9, 8, 16)
    check(heads[:, :4], want_q)
    check(heads[:, 4:6], want_k)
    assert torch.equal(heads[:, 6:], want_v)  # v untouched


@native
def test_bf16_prefill_reads_bf16_in_place_within_its_rounding() -> None:
    """bf16 q, k, v (strided views of the packed QKV) read in place: the float32 result
    rounded to bf16 once (within half a bf16 ulp of the exact value), plus, on the AVX-512
    BF16 body, the numerators' rounding (2^-8 of softmax @ |v|); declined shapes stay
    declined."""
    q, k, v = (t.to(torch.bfloat16) for t in _qkv_views())
    out = torch.empty(q.shape, dtype=torch.bfloat16)

    def exact(v):
        return F.scaled_dot_product_attention(
            q.double().transpose(0, 1).unsqueeze(0), k.double().transpose(0, 1).unsqueeze(0),
            v.double().transpose(0, 1).unsqueeze(0), is_causal=True, scale=0.2,
            enable_gqa=True)[0].transpose(0, 1)

    want = exact(v)
    bound = want.abs() * 2.0 ** -8 + 1e-6
    if kernels.bf16_prefill_rounds_probabilities():
        bound += exact(v.abs()) * 2.0 ** -8 * (1 + 2.0 ** -8)
    assert NativePrefill(kernels.load())(q, k, v, out, 0.2) is True
    assert ((out.double() - want).abs() <= bound).all()
    q, k, v = (t.to(torch.bfloat16) for t in _qkv_views(d=48))
    assert NativePrefill(kernels.load())(q, k, v, torch.empty(q.shape, dtype=torch.bfloat16),
                                         0.1) is False
