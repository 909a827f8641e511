"""Decode attention (one query token per sequence) over the paged KV cache.

Two implementations behind one signature ``(q, k_cache, v_cache, meta, scale)``, the
attention backends ``native`` and ``sdpa`` of ``backends.py``:

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

from conveyor.model.kernels import ops as native

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
    """The C kernel (float32 and bfloat16 caches) through the checked
    ``kernels.ops.decode_attention``."""

    needs_mask = False

    def __init__(self, lib) -> None:
        self.lib = lib

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float) -> torch.Tensor:
        fp32 = q.dtype is torch.float32
        out = native.decode_attention(q.contiguous() if fp32 else q.float().contiguous(),
                                      k_cache, v_cache, meta.decode_slots, meta.decode_lens,
                                      meta.decode_starts, scale, lib=self.lib)
        return out if fp32 else out.to(q.dtype)


sdpa_decode.needs_mask = True  # type: ignore[attr-defined]


class NativePrefill:
    """Causal attention of a fresh prompt through ``kernels/prefill_attention.c``.

    Reads q, k, v where the QKV projection left them (rows of a strided view) and writes
    ``out`` in place; declines (returns False) what it was not compiled for, and the
    segment then goes to SDPA. Anything else wrong with the tensors raises (the checked
    ``kernels.ops.prefill_attention``).
    """

    def __init__(self, lib) -> None:
        self.lib = lib

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 scale: float) -> bool:
        # float32, or bfloat16 read and written as such (float32 sums inside; the AVX-512
        # BF16 body also rounds the softmax numerators for P @ V, as SDPA does in bf16):
        # on a Zen 5, 4.3-4.6x SDPA's bf16 flash attention on the peers workload's
        # prompt lengths (benchmarks/prefill_attention.py).
        if not self._takes(q, k, v, out):
            return False
        return native.prefill_attention(q, k, v, out, scale, self.lib)

    def varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               segments: torch.Tensor, scale: float) -> bool:
        """The fresh prompts of a flat batch in one call (``AttentionMetadata.
        fresh_segments``: 7-8% less kernel time than a call a prompt on the peers
        workload's 2,048-token step, and one Python call a layer instead of ~14)."""
        if not segments.shape[1] or not self._takes(q, k, v, out):
            return False
        return native.prefill_attention_varlen(q, k, v, out, segments, scale, self.lib)

    @staticmethod
    def _takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> bool:
        d, dt = q.shape[2], q.dtype
        return (dt in (torch.float32, torch.bfloat16) and k.dtype == dt and v.dtype == dt
                and out.dtype == dt
                and all(x.stride(2) == 1 and x.stride(1) == d for x in (q, k, v, out))
                and k.stride(0) == v.stride(0))


def pick_decode_kernel(backend: str, device: torch.device, dtype: torch.dtype,
                       num_heads: int, num_kv_heads: int):
    """The decode callable of attention backend ``backend`` (``native``: the C kernel on
    CPU, ``sdpa``, any registered one, or ``auto``: the first registered that applies);
    see ``backends.py``."""
    from conveyor.model.backends import select_attention_backend

    return select_attention_backend(backend, device, dtype, num_heads,
                                    num_kv_heads).decode_kernel()
