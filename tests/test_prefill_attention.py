"""The native prefill-attention kernel equals causal attention on a fresh prompt (computed
in float64: the bound is the kernel's own rounding, not another float32 kernel's), reading
q, k and v where the packed QKV projection leaves them, in float32 and bfloat16, with every
body this CPU can run (its own ISA's, AVX2's, portable C's: each machine builds only its
own, so the others are built here with their ISA capped), and declines what it cannot do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conveyor.kernels import cpu as kernels
from conveyor.model.attention.native_prefill import NativePrefill

needs_native = pytest.mark.skipif(kernels.load() is None,
                                  reason="native kernels unavailable " + kernels.why_unavailable())


def qkv_views(length: int, hq: int, hkv: int, d: int, seed: int = 0,
              dtype: torch.dtype = torch.float32):
    """q, k, v as strided views into one packed [T, (Hq + 2 Hkv) * D] buffer."""
    torch.manual_seed(seed)
    qkv = torch.randn(length, (hq + 2 * hkv) * d).to(dtype)
    q = qkv[:, :hq * d].view(length, hq, d)
    k = qkv[:, hq * d:(hq + hkv) * d].view(length, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(length, hkv, d)
    return q, k, v


def reference(q, k, v, scale):
    """Causal attention in float64, returned in float32."""
    q, k, v = q.double(), k.double(), v.double()
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1).float()


def assert_within_bf16_bound(out, ref, q, k, v, scale, isa: str) -> None:
    """A bf16 output against the float64 reference: half a bf16 ulp of the value (2^-8)
    plus the float32 arithmetic's error, and, for a body that rounds the softmax
    numerators to bf16, 2^-8 of sum_j softmax_j |v_j| more."""
    err = (out.float() - ref).abs()
    bound = ref.abs() * 2.0 ** -8 + 2e-6
    if kernels.bf16_prefill_rounds_probabilities(isa):
        bound += reference(q, k, v.abs(), scale) * 2.0 ** -8 * (1 + 2.0 ** -8)
    assert (err <= bound).all(), (err - bound).max()


@needs_native
@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (8, 2), (6, 1)])
@pytest.mark.parametrize("length", [2, 15, 16, 17, 33, 130])
def test_native_prefill_equals_causal_sdpa(d: int, hq: int, hkv: int, length: int) -> None:
    q, k, v = qkv_views(length, hq, hkv, d, seed=length * d + hq)
    out = torch.full((length, hq, d), float("nan"))
    assert NativePrefill(kernels.load())(q, k, v, out, d ** -0.5)
    torch.testing.assert_close(out, reference(q, k, v, d ** -0.5), atol=2e-6, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("isa", kernels.isa_builds())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [16, 64, 128])
@pytest.mark.parametrize("hq,hkv,length", [(9, 3, 1), (9, 3, 47), (8, 2, 130), (6, 1, 17)])
def test_every_body_in_both_dtypes(isa: str, dtype: torch.dtype, d: int, hq: int, hkv: int,
                                   length: int) -> None:
    """bf16 is read and written as bf16, float32 inside: the float64 result rounded to bf16
    once, so within half a bf16 ulp (at most 2^-8 of the value: 8 significant bits) plus
    the float32 arithmetic's error. The body with AVX-512 BF16 also rounds the softmax
    numerators to bf16 for P @ V, as torch's CPU flash attention does in bf16: that adds at
    most 2^-8 of sum_j softmax_j |v_j| (each numerator within 2^-8 of itself, the
    denominator unrounded), and no more."""
    lib = kernels.load_variant(isa)
    q, k, v = qkv_views(length, hq, hkv, d, seed=length + d + hq, dtype=dtype)
    out = torch.full((length + 2, hq, d), float("nan"), dtype=dtype)
    assert NativePrefill(lib)(q, k, v, out[1:-1], d ** -0.5)
    assert out[0].isnan().all() and out[-1].isnan().all()  # only its own rows written
    ref = reference(q, k, v, d ** -0.5)
    if dtype is torch.float32:
        torch.testing.assert_close(out[1:-1], ref, atol=2e-6, rtol=1e-5)
    else:
        assert_within_bf16_bound(out[1:-1], ref, q, k, v, d ** -0.5, isa)


@needs_native
def test_native_prefill_writes_only_its_rows_of_a_larger_output() -> None:
    q, k, v = qkv_views(40, 4, 2, 32)
    out = torch.zeros(50, 4, 32)
    assert NativePrefill(kernels.load())(q, k, v, out[5:45], 0.2)
    torch.testing.assert_close(out[5:45], reference(q, k, v, 0.2), atol=2e-6, rtol=1e-5)
    assert out[:5].abs().sum() == 0 and out[45:].abs().sum() == 0


@needs_native
def test_native_prefill_declines_what_it_was_not_built_for() -> None:
    kernel = NativePrefill(kernels.load())
    q, k, v = qkv_views(8, 4, 2, 48)  # no copy compiled for head dim 48
    assert not kernel(q, k, v, torch.empty(8, 4, 48), 0.1)
    q, k, v = qkv_views(8, 4, 2, 32)
    assert not kernel(q.double(), k.double(), v.double(), torch.empty(8, 4, 32), 0.1)
    assert not kernel(q.bfloat16(), k.bfloat16(), v.bfloat16(), torch.empty(8, 4, 32), 0.1)
    assert not kernel(q.transpose(1, 2).contiguous().transpose(1, 2), k, v,
                      torch.empty(8, 4, 32), 0.1)  # heads not contiguous within a row


def test_kernel_isa_names_a_known_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVEYOR_KERNEL_ISA", "avx2")
    assert kernels.kernel_isa() == "avx2"
    monkeypatch.setenv("CONVEYOR_KERNEL_ISA", "sse9")
    with pytest.raises(ValueError, match="CONVEYOR_KERNEL_ISA"):
        kernels.kernel_isa()


@needs_native
@pytest.mark.skipif("amx_bf16" not in (kernels.cpu_flags() or ()), reason="the CPU has no AMX-BF16")
def test_amx_body_runs_where_the_cpu_has_amx() -> None:
    """On a CPU with AMX the native build takes bf16 prompts on tiles (the OS grants the
    tile state); a capped build does not. Without this a refused permission would fall
    back to the AVX-512 body silently (still correct, 1.5-3x slower)."""
    assert kernels.load_variant("native").amx_tiles_available() == 1
    assert kernels.load_variant("avx512bf16").amx_tiles_available() == 0


@needs_native
@pytest.mark.parametrize("isa", kernels.isa_builds())
@pytest.mark.parametrize("length", [31, 32, 33, 64, 300])
def test_bf16_bodies_across_key_block_edges(isa: str, length: int) -> None:
    """Lengths around the AMX body's blocks (16 query rows, 32 keys), and a prompt long
    enough that a row's reference max moves after its first block (the scores grow along
    the prompt), with head dims 32 and 64 (output in tiles) and 128 (through memory)."""
    lib = kernels.load_variant(isa)
    for d in (32, 64, 128):
        q, k, v = qkv_views(length, 8, 2, d, seed=length + d, dtype=torch.bfloat16)
        k.mul_(torch.linspace(0.5, 4.0, length).view(length, 1, 1).to(torch.bfloat16))
        out = torch.full((length, 8, d), float("nan"), dtype=torch.bfloat16)
        assert NativePrefill(lib)(q, k, v, out, d ** -0.5)
        assert_within_bf16_bound(out, reference(q, k, v, d ** -0.5), q, k, v, d ** -0.5, isa)


def _flat_batch(lengths: list[int], gaps: int, hq: int, hkv: int, d: int, dtype):
    """q, k, v of a flat batch holding the prompts with ``gaps`` rows before each (the
    rows a step's decodes or other segments hold), and the [2, S] segments table."""
    starts, row = [], 0
    for n in lengths:
        row += gaps
        starts.append(row)
        row += n
    q, k, v = qkv_views(row, hq, hkv, d, seed=row, dtype=dtype)
    return q, k, v, torch.tensor([starts, lengths], dtype=torch.int32)


@needs_native
@pytest.mark.parametrize("isa", kernels.isa_builds())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lengths", [[47], [130, 17, 1, 64, 33, 2], [300, 20, 9, 16]])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_varlen_equals_a_call_a_prompt_bit_for_bit(isa: str, dtype: torch.dtype,
                                                   lengths: list[int], threads: int) -> None:
    """All of a step's fresh prompts in one call: the same output as a call per prompt
    (a prompt's tasks do not depend on which thread, or how many, run them), whichever
    prompts run alone on every thread (the long one) and which one to a thread; the rows
    between prompts untouched."""
    lib = kernels.load_variant(isa)
    q, k, v, segments = _flat_batch(lengths, 3, 9, 3, 64, dtype)
    want = torch.full(q.shape, float("nan"), dtype=dtype)
    for s, n in segments.t().tolist():
        assert NativePrefill(lib)(q[s:s + n], k[s:s + n], v[s:s + n], want[s:s + n], 0.125)
    got = torch.full(q.shape, float("nan"), dtype=dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert NativePrefill(lib).varlen(q, k, v, got, segments, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got.isnan(), want.isnan())  # the same rows written, the gaps not
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@needs_native
def test_varlen_refuses_segments_outside_the_rows_and_declines_unbuilt_head_dims() -> None:
    from conveyor.kernels.cpu import ops

    q, k, v, segments = _flat_batch([5, 7], 1, 4, 2, 32, torch.float32)
    out = torch.empty(q.shape)
    assert segments.tolist() == [[1, 7], [5, 7]]  # the last prompt ends at row 14 of 14
    assert ops.prefill_attention_varlen(q, k, v, out, segments, 0.2)
    for starts, lens, says in (([1, 8], [5, 7], "inside the 14 rows"),
                               ([1, 7], [5, 0], "lengths >= 1"),
                               ([-1, 7], [5, 7], "inside the 14 rows")):
        table = torch.tensor([starts, lens], dtype=torch.int32)
        with pytest.raises(ValueError, match=says):
            ops.prefill_attention_varlen(q, k, v, out, table, 0.2)
    with pytest.raises(ValueError, match="segments must be int32"):
        ops.prefill_attention_varlen(q, k, v, out, segments.long(), 0.2)
    with pytest.raises(ValueError, match=r"segments must have shape \[2, S\]"):
        ops.prefill_attention_varlen(q, k, v, out, segments[:1].contiguous(), 0.2)
    with pytest.raises(ValueError, match="conveyor::prefill_attention_varlen: out"):
        ops.prefill_attention_varlen(q, k, v, out.double(), segments, 0.2)
    q, k, v, segments = _flat_batch([5, 7], 1, 4, 2, 48, torch.float32)  # no d=48 copy
    assert not NativePrefill(kernels.load()).varlen(q, k, v, torch.empty(q.shape), segments,
                                                    0.2)
