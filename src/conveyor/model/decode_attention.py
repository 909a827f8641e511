"""Decode attention (one query token per sequence) over the paged KV cache.

Two implementations behind one signature ``(q, k_cache, v_cache, meta, scale)``:

- ``native`` (CPU): the C kernel of ``kernels/decode_attention.c`` reads each context
  K/V row once, straight from its slot; nothing is gathered or padded.
- ``sdpa`` (any device): gathers every sequence's context into a padded
  ``[B, max_ctx, Hkv, D]`` copy and calls ``scaled_dot_product_attention`` with a mask.
  Three passes over the KV bytes plus the padding, but it runs anywhere (CUDA included).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from conveyor.model import kernels

if TYPE_CHECKING:
    from conveyor.model.attention import AttentionMetadata

def sdpa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [B, Hq, D]; caches: [num_slots, Hkv, D]. Returns [B, Hq, D]."""
    b = q.shape[0]
    k = k_cache[meta.decode_slots].transpose(1, 2)  # [B, Hkv, max_ctx, D]
    v = v_cache[meta.decode_slots].transpose(1, 2)
    mask = meta.decode_mask.view(b, 1, 1, -1)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(2)


class NativeDecode:
    """The C kernel through ctypes (float32 and bfloat16 caches)."""

    needs_mask = False

    def __init__(self, lib) -> None:
        self.lib = lib
        self._fns = {torch.float32: lib.decode_attention_f32,
                     torch.bfloat16: lib.decode_attention_bf16}

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float) -> torch.Tensor:
        b, hq, d = q.shape
        q32 = q.float().contiguous()
        out = torch.empty((b, hq, d), dtype=torch.float32)
        slots = meta.decode_slots
        self._fns[k_cache.dtype](
            q32.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
            meta.decode_lens.data_ptr(), meta.decode_starts.data_ptr(), out.data_ptr(),
            b, hq, k_cache.shape[1], d, slots.shape[1], scale)
        return out if q.dtype == torch.float32 else out.to(q.dtype)


sdpa_decode.needs_mask = True  # type: ignore[attr-defined]


class NativePrefill:
    """Causal attention of a fresh prompt through ``kernels/prefill_attention.c``.

    Reads q, k, v where the QKV projection left them (rows of a strided view) and writes
    ``out`` in place; declines (returns False) what it was not compiled for, and the
    segment then goes to SDPA.
    """

    def __init__(self, lib) -> None:
        self.fn = lib.prefill_attention_f32

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 scale: float) -> bool:
        t, hq, d = q.shape
        if (q.dtype != torch.float32 or k.dtype != torch.float32 or out.dtype != torch.float32
                or any(x.stride(2) != 1 or x.stride(1) != d for x in (q, k, v, out))
                or k.stride(0) != v.stride(0)):
            return False
        return self.fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), t, hq,
                       k.shape[1], d, q.stride(0), k.stride(0), out.stride(0), scale) == 0


def pick_decode_kernel(backend: str, device: torch.device, dtype: torch.dtype,
                       num_heads: int, num_kv_heads: int):
    """``native`` (C kernel, CPU), ``sdpa``, or ``auto``: native where it applies."""
    if backend not in ("auto", "sdpa", "native"):
        raise ValueError(f"attention_backend must be auto, native or sdpa, got {backend!r}")
    applies = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    if backend == "sdpa" or (backend == "auto" and not applies):
        return sdpa_decode
    if not applies:
        raise ValueError("attention_backend='native' needs a CPU device and a float32 or "
                         "bfloat16 model")
    lib = kernels.load()
    if lib is None:
        if backend == "native":
            raise RuntimeError("attention_backend='native': the native kernels are unavailable "
                               + kernels.why_unavailable())
        return sdpa_decode
    return NativeDecode(lib)
