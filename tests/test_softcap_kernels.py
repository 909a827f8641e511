"""Gemma 2's attention logit soft-capping inside the native kernels (``softcap.h``): the
decode kernel (float32, bf16 and one-byte caches; vector and generic bodies) and the
prefill kernel (every body this CPU can build, both dtypes, one call a layer) equal
capped attention computed in float64, with GQA and sliding windows; ``paged_attention``
routes a capped layer to them on the native backend and to ``softcap.py`` elsewhere."""

from __future__ import annotations

import pytest
import torch
from test_decode_attention import _raw_call, paged_case
from test_prefill_attention import _flat_batch, qkv_views

from conveyor.kernels import cpu as kernels
from conveyor.kernels.cpu import ops
from conveyor.model.attention.metadata import AttentionMetadata, PrefillSegment
from conveyor.model.attention.native_decode import NativeDecode
from conveyor.model.attention.native_prefill import NativePrefill
from conveyor.model.attention.paged import paged_attention
from conveyor.model.attention.softcap import capped_paged_attention
from conveyor.model.quant.kv_cache import QuantizedKV

needs_native = pytest.mark.skipif(kernels.load() is None,
                                  reason="native kernels unavailable " + kernels.why_unavailable())


def capped_reference(q, k, v, mask, scale: float, cap: float | None) -> torch.Tensor:
    """q [Lq, Hq, D], k and v [Lk, Hkv, D], mask [Lq, Lk] bool (True = attend): capped
    (None: uncapped) attention in float64 (query head h reads KV head h // G)."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, 1).transpose(0, 1)  # [Hq, Lk, D]
    v = v.repeat_interleave(g, 1).transpose(0, 1)
    s = q.transpose(0, 1) @ k.transpose(1, 2) * scale  # [Hq, Lq, Lk]
    if cap is not None:
        s = torch.tanh(s / cap) * cap
    s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ v).transpose(0, 1)


def decode_reference(q, k_cache, v_cache, meta, scale, cap) -> torch.Tensor:
    return torch.stack([
        capped_reference(q[b:b + 1], k_cache[meta.decode_slots[b][meta.decode_mask[b]]],
                         v_cache[meta.decode_slots[b][meta.decode_mask[b]]],
                         torch.ones(1, int(meta.decode_mask[b].sum()), dtype=torch.bool),
                         scale, cap)[0]
        for b in range(q.shape[0])])


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def _capped_raw(fn, q, k, v, meta, scale, cap) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32)
    slots, lens, starts = meta.decode_slots, meta.decode_lens, meta.decode_starts
    fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), slots.data_ptr(), lens.data_ptr(),
       starts.data_ptr(), out.data_ptr(), q.shape[0], q.shape[1], k.shape[1], q.shape[2],
       slots.shape[1], scale, cap)
    return out


def test_the_reference_caps() -> None:
    """(The reference itself: a cap that bites changes the result, a huge one does not.)"""
    q, k, v = qkv_views(9, 4, 2, 16, seed=1)
    q = q * 4
    plain = capped_reference(q, k, v, causal(9), 0.25, None)
    assert not torch.allclose(capped_reference(q, k, v, causal(9), 0.25, 0.5), plain)


@needs_native
@pytest.mark.parametrize("isa", kernels.isa_builds())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hkv, d", [(8, 2, 256), (9, 3, 64), (4, 4, 16), (4, 1, 12)])
@pytest.mark.parametrize("cap", [0.5, 50.0])
def test_capped_decode_on_every_build(isa, dtype, hq, hkv, d, cap) -> None:
    """The entry (vector body where D is a multiple of the vector width, generic at 12)
    and the generic body alone, with a window and without; q scaled up so that scores
    reach the cap's curved part at 50 too."""
    lib = kernels.load_variant(isa)
    scale = d ** -0.5
    for window in (None, 21):
        q, k, v, meta = paged_case(6, hq, hkv, d, 16, torch.float32, window, seed=d + hq)
        q = q * 8
        k, v = k.to(dtype), v.to(dtype)
        want = decode_reference(q, k, v, meta, scale, cap)
        suffix = "f32" if dtype is torch.float32 else "bf16"
        for name in (f"decode_attention_{suffix}_capped",
                     f"decode_attention_{suffix}_generic_capped"):
            got = _capped_raw(getattr(lib, name), q, k, v, meta, scale, cap)
            torch.testing.assert_close(got.double(), want, atol=5e-6, rtol=1e-5, msg=name)
        # the uncapped names stay uncapped (a cap of 0 is none)
        plain = _raw_call(getattr(lib, f"decode_attention_{suffix}"), q, k, v, meta, scale)
        torch.testing.assert_close(
            plain, _capped_raw(getattr(lib, f"decode_attention_{suffix}_capped"), q, k, v,
                               meta, scale, 0.0), atol=0, rtol=0)


@needs_native
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("d", [64, 12])
def test_capped_decode_over_one_byte_caches(kv_dtype: str, d: int) -> None:
    """``decode_attention_q8`` with a cap equals the float64 capped attention over the
    cache's dequantised values (the codes times their scales)."""
    q, k, v, meta = paged_case(5, 8, 2, d, 16, torch.float32, 9, seed=d)
    q = q * 8
    slots = torch.arange(k.shape[0])
    kq, vq = (QuantizedKV(k.shape[0], 2, d, kv_dtype, torch.float32, torch.device("cpu"))
              for _ in range(2))
    kq.index_copy_(0, slots, k)
    vq.index_copy_(0, slots, v)
    kd, vd = kq[slots], vq[slots]
    want = decode_reference(q, kd, vd, meta, d ** -0.5, 0.5)
    got = NativeDecode(kernels.load())(q, kq, vq, meta, d ** -0.5, softcap=0.5)
    torch.testing.assert_close(got.double(), want, atol=5e-6, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("isa", kernels.isa_builds())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 64, 128, 256])
@pytest.mark.parametrize("hq,hkv,length", [(9, 3, 1), (9, 3, 47), (8, 2, 130), (6, 1, 17)])
@pytest.mark.parametrize("cap", [0.5, None])
def test_capped_prefill_every_body_in_both_dtypes(isa, dtype, d, hq, hkv, length,
                                                  cap) -> None:
    """The cap is applied before the causal mask (a masked key stays out, whatever its
    capped score); bf16 within the bound of test_prefill_attention's uncapped bodies.
    Head dim 256 (Gemma 2's) has its own copies, capped or not."""
    lib = kernels.load_variant(isa)
    q, k, v = qkv_views(length, hq, hkv, d, seed=length + d + hq, dtype=dtype)
    if cap is not None:  # scores up to where the cap bends them
        q = (q.float() * 4).to(dtype)
    scale = d ** -0.5
    out = torch.full((length + 2, hq, d), float("nan"), dtype=dtype)
    assert NativePrefill(lib)(q, k, v, out[1:-1], scale, softcap=cap)
    assert out[0].isnan().all() and out[-1].isnan().all()
    ref = capped_reference(q, k, v, causal(length), scale, cap)
    if dtype is torch.float32:
        torch.testing.assert_close(out[1:-1].double(), ref, atol=2e-6, rtol=1e-5)
    else:
        assert_capped_bf16(out[1:-1], ref, q, k, v, scale, cap, isa)


def assert_capped_bf16(out, ref, q, k, v, scale, cap, isa) -> None:
    """test_prefill_attention's bf16 bound (``assert_within_bf16_bound``) over the capped
    reference."""
    err = (out.double() - ref).abs()
    bound = ref.abs() * 2.0 ** -8 + 2e-6
    if kernels.bf16_prefill_rounds_probabilities(isa):
        bound += capped_reference(q, k, v.abs(), causal(q.shape[0]), scale, cap) * (
            2.0 ** -8 * (1 + 2.0 ** -8))
    assert (err <= bound).all(), (err - bound).max()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capped_varlen_equals_a_call_a_prompt_bit_for_bit(dtype: torch.dtype) -> None:
    lib = kernels.load()
    q, k, v, segments = _flat_batch([130, 17, 1, 64, 33, 2], 3, 9, 3, 64, dtype)
    want = torch.full(q.shape, float("nan"), dtype=dtype)
    for s, n in segments.t().tolist():
        assert NativePrefill(lib)(q[s:s + n], k[s:s + n], v[s:s + n], want[s:s + n], 0.125,
                                  softcap=0.5)
    got = torch.full(q.shape, float("nan"), dtype=dtype)
    assert NativePrefill(lib).varlen(q, k, v, got, segments, 0.125, softcap=0.5)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    s, n = segments[:, 0].tolist()
    ref = capped_reference(q[s:s + n], k[s:s + n], v[s:s + n], causal(n), 0.125, 0.5)
    if dtype is torch.float32:
        torch.testing.assert_close(got[s:s + n].double(), ref, atol=2e-6, rtol=1e-5)


@needs_native
def test_a_negative_or_nan_cap_is_refused() -> None:
    q, k, v, meta = paged_case(2, 4, 2, 16, 16, torch.float32)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="softcap"):
            ops.decode_attention(q, k, v, meta.decode_slots, meta.decode_lens,
                                 meta.decode_starts, 0.25, softcap=bad)


def _mixed_step(hq: int, hkv: int, d: int, seed: int = 0):
    """A step of 3 decode rows, a fresh 20-token prompt and a 7-token chunk over a cached
    13-token prefix, over one paged cache (slots of each sequence contiguous)."""
    torch.manual_seed(seed)
    ctx = [9, 30, 4]  # decode rows' contexts (their last token is this step's)
    fresh, prefix, chunk = 20, 13, 7
    total = sum(ctx) + fresh + prefix + chunk
    k_cache = torch.randn(total + 5, hkv, d)
    v_cache = torch.randn(total + 5, hkv, d)
    starts = torch.tensor([0, 9, 39, 43, 63], dtype=torch.long)  # each sequence's slot base
    dec_slots = torch.zeros(3, max(ctx), dtype=torch.long)
    for b, n in enumerate(ctx):
        dec_slots[b, :n] = starts[b] + torch.arange(n)
    new_slots = torch.cat([dec_slots[b, n - 1:n] for b, n in enumerate(ctx)]
                          + [starts[3] + torch.arange(fresh),
                             starts[4] + prefix + torch.arange(chunk)])
    t = len(new_slots)
    q, k, v = torch.randn(t, hq, d) * 6, torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    ctx_slots = starts[4] + torch.arange(prefix + chunk)
    mask = torch.ones(chunk, prefix + chunk, dtype=torch.bool).tril(prefix)
    lens = torch.tensor(ctx, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=new_slots, num_decodes=3, decode_slots=dec_slots, decode_lens=lens,
        decode_starts=torch.zeros(3, dtype=torch.int32),
        prefills=[PrefillSegment(3, fresh), PrefillSegment(3 + fresh, chunk, ctx_slots, mask)])
    return q, k, v, k_cache, v_cache, meta


def _softcap_py(q, k, v, k_cache, v_cache, meta) -> torch.Tensor:
    """softcap.py's result on the step (its K/V written into copies of the caches first)."""
    kc, vc = k_cache.clone(), v_cache.clone()
    kc[meta.slot_mapping], vc[meta.slot_mapping] = k, v
    return capped_paged_attention(q, k, v, kc, vc, meta, 0.25, 0.5)


@needs_native
def test_paged_attention_runs_capped_layers_on_the_native_kernels(monkeypatch) -> None:
    """A capped mixed step on the native kernels: the decode rows and the fresh prompt in
    C with the cap (softcap.py only for the chunk over a cached prefix), equal to
    softcap.py's result on the whole step."""
    lib = kernels.load()
    q, k, v, kc, vc, meta = _mixed_step(4, 2, 16)
    want = _softcap_py(q, k, v, kc, vc, meta)
    calls = []
    decode, prefill = NativeDecode(lib), NativePrefill(lib)

    def spy_decode(*args, **kwargs):
        calls.append(("decode", kwargs.get("softcap")))
        return decode(*args, **kwargs)

    spy_decode.takes_softcap = True
    meta.decode_kernel, meta.prefill_kernel = spy_decode, prefill
    monkeypatch.setattr("conveyor.model.attention.paged.capped_paged_attention", None)
    got = paged_attention(q, k, v, kc, vc, meta, 0.25, softcap=0.5)
    assert calls == [("decode", 0.5)]
    torch.testing.assert_close(got, want, atol=5e-6, rtol=1e-5)


def test_paged_attention_keeps_softcap_py_where_the_kernel_takes_no_cap() -> None:
    """SDPA's decode kernel takes no cap: the whole capped layer goes to softcap.py."""
    from conveyor.model.attention.sdpa import sdpa_decode

    q, k, v, kc, vc, meta = _mixed_step(4, 2, 16, seed=1)
    want = _softcap_py(q, k, v, kc, vc, meta)
    cols = torch.arange(meta.decode_slots.shape[1])
    meta.decode_mask = cols[None, :] < meta.decode_lens[:, None]
    meta.decode_kernel = sdpa_decode
    got = paged_attention(q, k, v, kc, vc, meta, 0.25, softcap=0.5)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@needs_native
@pytest.mark.parametrize("config", ["batched", "chunked", "preempt", "prefix_hits"])
def test_gemma2_greedy_ids_with_the_cap_in_the_native_kernels(config: str, monkeypatch) -> None:
    """The tiny Gemma 2 (caps that bite, windows shorter than the prompts) on the native
    backend: greedy ids equal transformers', every capped decode row and fresh prompt
    through the C kernels with the cap (softcap.py's whole-layer path refused)."""
    import random

    from conveyor import LLM, SamplingParams

    from test_families import CONFIGS, _batch, _check, checkpoint

    def refuse(*args, **kwargs):
        raise AssertionError("a capped layer left the native kernels")

    capped = {"decode": 0, "prefill": 0}
    decode, varlen = ops.decode_attention, ops.prefill_attention_varlen

    def spy_decode(*args, softcap=0.0, **kwargs):
        capped["decode"] += softcap > 0
        return decode(*args, softcap=softcap, **kwargs)

    def spy_varlen(*args, softcap=0.0, **kwargs):
        capped["prefill"] += softcap > 0
        return varlen(*args, softcap=softcap, **kwargs)

    monkeypatch.setattr("conveyor.model.attention.paged.capped_paged_attention", refuse)
    monkeypatch.setattr(ops, "decode_attention", spy_decode)
    monkeypatch.setattr(ops, "prefill_attention_varlen", spy_varlen)
    path = checkpoint("gemma2")
    if config == "prefix_hits":  # cached prefixes longer than the window
        rng = random.Random(7)
        base = [rng.randrange(4, 384) for _ in range(40)]
        prompts = [base[:19] + [12, 13], base[:40], base[:40] + [14], base[:33]]
        params = [SamplingParams(max_tokens=6, temperature=0.0) for _ in prompts]
        args = dict(block_size=8, num_kv_blocks=64, max_num_seqs=1)
    else:
        prompts, params = _batch()
        args = CONFIGS.get(config, {})
    llm = LLM(path, dtype="float32", attention_backend="native", **args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    _check(path, outs, prompts, params)
    assert capped["decode"] > 0 and capped["prefill"] > 0, capped
    stats = llm.stats()
    if config == "preempt":
        assert stats["num_preemptions"] > 0
    if config == "prefix_hits":
        assert stats["prefix_cache_hits"] > 0


@needs_native
@pytest.mark.parametrize("isa", kernels.isa_builds())
def test_gelu_tanh_mul_and_the_final_cap_equal_torch_to_rounding(isa: str) -> None:
    """Gemma's GeGLU and Gemma 2's final logit cap in one native pass each, against
    torch in float64: within a few float32 ulps (a tanh accurate to ~1.5 ulp, then the
    products' roundings), over the inputs' whole useful range (tanh's polynomial and exp
    branches, saturation)."""
    lib = kernels.load_variant(isa)
    torch.manual_seed(0)
    gu = torch.randn(5, 2 * 300) * 4
    want = (torch.nn.functional.gelu(gu[:, :300].double(), approximate="tanh")
            * gu[:, 300:].double())
    got = torch.empty(5, 300)
    lib.gelu_tanh_mul_f32(gu.data_ptr(), got.data_ptr(), 5, 300)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=4e-7)
    x = torch.cat([torch.randn(40_000) * 30, torch.linspace(-400.0, 400.0, 1001)])
    want = torch.tanh(x.double() / 30.0) * 30.0
    got = x.clone()
    lib.softcap_f32(got.data_ptr(), got.numel(), 30.0)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=4e-7)
    assert torch.equal(ops.softcap_(x.clone(), 30.0), got) or isa != "native"
