"""Decode-attention kernels: the native C kernel equals gather + SDPA on paged layouts."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from conveyor.kernels import cpu as kernels
from conveyor.model.attention.metadata import AttentionMetadata
from conveyor.model.attention.native_decode import NativeDecode
from conveyor.model.attention.registry import pick_decode_kernel
from conveyor.model.attention.sdpa import sdpa_decode

needs_native = pytest.mark.skipif(kernels.load() is None,
                                  reason="native kernels unavailable " + kernels.why_unavailable())
FP32_CASES = [(1, 4, 4, 16, 16, None), (5, 8, 2, 32, 4, None), (9, 9, 3, 64, 16, None),
              (2, 6, 1, 8, 1, None), (7, 8, 2, 64, 16, 5), (3, 16, 8, 128, 16, None),
              (2, 130, 2, 16, 16, None)]  # the last: a large query group (per-call buffers)


def paged_case(batch: int, hq: int, hkv: int, d: int, block: int, dtype: torch.dtype,
               window: int | None = None, seed: int = 0, lens: list[int] | None = None):
    """Random contexts (of ``lens`` tokens where given) scattered over shuffled blocks,
    padded to the longest."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    lens = lens or [rng.randint(1, 90) for _ in range(batch)]
    num_blocks = sum(-(-n // block) for n in lens) + 3
    k_cache = torch.randn(num_blocks * block, hkv, d).to(dtype)
    v_cache = torch.randn(num_blocks * block, hkv, d).to(dtype)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    max_len = max(lens)
    cols = torch.arange(max_len)
    slots = torch.zeros(batch, max_len, dtype=torch.long)
    for b, n in enumerate(lens):
        table = torch.tensor([free.pop() for _ in range(-(-n // block))])
        real = table[(cols // block).clamp(max=len(table) - 1)] * block + cols % block
        slots[b] = torch.where(cols < n, real, torch.zeros_like(real))  # padding: slot 0
    lens_t = torch.tensor(lens, dtype=torch.int32)
    starts = (lens_t - window).clamp(min=0).to(torch.int32) if window else torch.zeros_like(
        lens_t)
    mask = (cols[None, :] < lens_t[:, None]) & (cols[None, :] >= starts[:, None])
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=batch,
                             decode_slots=slots, decode_lens=lens_t, decode_starts=starts,
                             decode_mask=mask)
    q = torch.randn(batch, hq, d).to(dtype)
    return q, k_cache, v_cache, meta


def reference(q, k_cache, v_cache, meta, scale):
    """Per sequence, attention over exactly its attended positions, in float64."""
    out = []
    for b in range(q.shape[0]):
        idx = meta.decode_slots[b][meta.decode_mask[b]]
        k = k_cache[idx].double().transpose(0, 1)  # [Hkv, n, D]
        v = v_cache[idx].double().transpose(0, 1)
        o = F.scaled_dot_product_attention(q[b].double().unsqueeze(1), k, v, scale=scale,
                                           enable_gqa=True)
        out.append(o.squeeze(1))
    return torch.stack(out)


@needs_native
@pytest.mark.parametrize("batch, hq, hkv, d, block, window", FP32_CASES)
def test_native_kernel_matches_reference_fp32(batch, hq, hkv, d, block, window) -> None:
    q, k, v, meta = paged_case(batch, hq, hkv, d, block, torch.float32, window, seed=batch)
    want = reference(q, k, v, meta, d ** -0.5)
    got = NativeDecode(kernels.load())(q, k, v, meta, d ** -0.5)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("batch, hq, hkv, d, block, window", FP32_CASES)
def test_sdpa_decode_matches_reference_fp32(batch, hq, hkv, d, block, window) -> None:
    """The fallback (what runs without the native kernels) on the same paged layouts."""
    q, k, v, meta = paged_case(batch, hq, hkv, d, block, torch.float32, window, seed=batch)
    want = reference(q, k, v, meta, d ** -0.5)
    torch.testing.assert_close(sdpa_decode(q, k, v, meta, d ** -0.5).double(), want,
                               atol=2e-6, rtol=1e-5)


@needs_native
def test_native_kernel_reads_bf16_caches() -> None:
    q, k, v, meta = paged_case(6, 9, 3, 64, 16, torch.bfloat16, seed=4)
    want = reference(q, k, v, meta, 0.125)
    got = NativeDecode(kernels.load())(q, k, v, meta, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


def test_backend_choice_and_errors() -> None:
    cpu = torch.device("cpu")
    assert pick_decode_kernel("sdpa", cpu, torch.float32, 8, 2) is sdpa_decode
    # float16 has no native kernel: auto falls back, native refuses.
    assert pick_decode_kernel("auto", cpu, torch.float16, 8, 2) is sdpa_decode
    with pytest.raises(ValueError, match="native"):
        pick_decode_kernel("native", cpu, torch.float16, 8, 2)
    with pytest.raises(ValueError, match="must be one of auto, native, sdpa"):
        pick_decode_kernel("fast", cpu, torch.float32, 8, 2)


@needs_native
def test_native_layer_ops_match_torch_ops() -> None:
    from conveyor.model.layers.norm import RMSNorm
    from conveyor.model.layers.ops import NativeOps, TorchOps
    from conveyor.model.layers.rotary import RotaryEmbedding

    torch.manual_seed(0)
    native, ref = NativeOps(kernels.load()), TorchOps()
    norm = RMSNorm(48, 1e-5)
    norm.weight.data.normal_()
    x, residual = torch.randn(13, 48), torch.randn(13, 48)
    torch.testing.assert_close(native.rms_norm(x, norm), ref.rms_norm(x, norm))
    want_out, want_res = ref.add_rms_norm(x, residual.clone(), norm)
    got_out, got_res = native.add_rms_norm(x, residual.clone(), norm)
    torch.testing.assert_close(got_out, want_out)
    torch.testing.assert_close(got_res, want_res)
    gate_up = torch.randn(5, 2 * 40)
    torch.testing.assert_close(native.silu_mul(gate_up, 40), ref.silu_mul(gate_up, 40))
    rope = RotaryEmbedding({"rope_theta": 10000.0}, 16, 64)
    qkv = torch.randn(7, (4 + 2 * 2) * 16)
    positions = torch.tensor([0, 3, 9, 63, 1, 2, 40])
    want = ref.rope_(rope, positions, qkv.clone(), 4, 2, 16)
    got = native.rope_(rope, positions, qkv.clone(), 4, 2, 16)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@needs_native
def test_loading_kernels_keeps_subnormals() -> None:
    """Linking any of our libraries with -ffast-math would flush denormals to zero
    process-wide."""
    import subprocess
    import sys

    code = ("import torch\nfrom conveyor.kernels import cpu as kernels\n"
            "from conveyor.kernels.cpu import logprob_rows, quant, token_bitmask\n"
            "assert kernels.load()\nassert quant.load()\nassert logprob_rows.load()\n"
            "assert token_bitmask.load()\n"
            "x = torch.tensor([1e-40])\nassert (x * 1.0).item() != 0.0, 'flush-to-zero is on'")
    subprocess.run([sys.executable, "-c", code], check=True)


def _raw_call(fn, q, k, v, meta, scale) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32)
    slots, lens, starts = meta.decode_slots, meta.decode_lens, meta.decode_starts
    fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), slots.data_ptr(), lens.data_ptr(),
       starts.data_ptr(), out.data_ptr(), q.shape[0], q.shape[1], k.shape[1], q.shape[2],
       slots.shape[1], scale)
    return out


@needs_native
@pytest.mark.parametrize("isa", kernels.isa_builds())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq, hkv, d", [(9, 3, 64), (8, 2, 128), (6, 2, 48), (4, 1, 12),
                                        (130, 2, 16)])
def test_vector_and_generic_bodies_on_every_build(isa, dtype, hq, hkv, d) -> None:
    """Each build's entry (the vector body where D is a multiple of its vector width:
    specialized at 64 and 128, any multiple else; the generic one at D = 12) and the
    generic body alone equal the float64 reference, on contexts of 1 to 90 positions
    (chunk edges at 16), a sliding window included. Keys grow along the context, so a
    head's running max moves from chunk to chunk and the rescale is exercised."""
    lib = kernels.load_variant(isa)
    for window in (None, 21):
        q, k, v, meta = paged_case(7, hq, hkv, d, 16, torch.float32, window, seed=d + hq)
        ramp = torch.linspace(0.0, 3.0, k.shape[0])[:, None, None]
        k = (k + ramp).to(dtype)  # (slots are shuffled: the ramp is along the cache)
        v = v.to(dtype)
        want = reference(q, k.float(), v.float(), meta, d ** -0.5)
        generic = (lib.decode_attention_f32_generic if dtype is torch.float32
                   else lib.decode_attention_bf16_generic)
        entry = lib.decode_attention_f32 if dtype is torch.float32 else lib.decode_attention_bf16
        for fn in (entry, generic):
            got = _raw_call(fn, q, k, v, meta, d ** -0.5)
            torch.testing.assert_close(got.double(), want, atol=5e-6, rtol=1e-5)
        if dtype is torch.bfloat16:
            # a bf16 model's q holds bf16 values: where the build has AVX-512 BF16 the
            # scores run by vdpbf16ps (exact products, fp32 sums in another order)
            qb = q.to(torch.bfloat16).float()
            want = reference(qb, k.float(), v.float(), meta, d ** -0.5)
            got = _raw_call(entry, qb, k, v, meta, d ** -0.5)
            torch.testing.assert_close(got.double(), want, atol=5e-6, rtol=1e-5)


@needs_native
def test_native_decode_calls_the_library_it_was_given() -> None:
    """A backend built on one library (a capped build, a test's) runs that one, not the
    process's own."""
    calls = []

    class Recorder:
        def decode_attention_f32(self, *args):
            calls.append(args)

    q, k, v, meta = paged_case(2, 4, 2, 16, 16, torch.float32, None, seed=3)
    NativeDecode(Recorder())(q, k, v, meta, 0.25)
    assert len(calls) == 1 and calls[0][0] == q.data_ptr()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 300])
def test_long_contexts_split_into_segments_alike_in_any_batch(dtype, window) -> None:
    """A context longer than the kernel's segment (128 positions) is cut into segments run
    as tasks of their own and combined (a batch of one keeps every thread busy): the
    result equals the float64 reference, and a sequence's result is bit for bit the same
    alone as beside others (the cut depends on its own length only). Lengths: one
    segment, the first cut, three segments, past the cap of eight."""
    entry = (kernels.load().decode_attention_f32 if dtype is torch.float32
             else kernels.load().decode_attention_bf16)
    lens = [128, 129, 300, 1500]
    q, k, v, meta = paged_case(len(lens), 9, 3, 64, 16, torch.float32, window, seed=3,
                               lens=lens)
    ramp = torch.linspace(0.0, 3.0, k.shape[0])[:, None, None]  # the running max moves
    k, v = (k + ramp).to(dtype), v.to(dtype)
    together = _raw_call(entry, q, k, v, meta, 0.125)
    want = reference(q, k.float(), v.float(), meta, 0.125)
    torch.testing.assert_close(together.double(), want, atol=5e-6, rtol=1e-5)
    for b in range(len(lens)):
        one = AttentionMetadata(
            slot_mapping=meta.slot_mapping, num_decodes=1,
            decode_slots=meta.decode_slots[b:b + 1].contiguous(),
            decode_lens=meta.decode_lens[b:b + 1].contiguous(),
            decode_starts=meta.decode_starts[b:b + 1].contiguous(),
            decode_mask=meta.decode_mask[b:b + 1])
        alone = _raw_call(entry, q[b:b + 1].contiguous(), k, v, one, 0.125)
        assert torch.equal(alone[0], together[b]), f"sequence {b} ({lens[b]} positions)"
