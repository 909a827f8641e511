"""The reference attention backend: gather + padded ``scaled_dot_product_attention``.

Gathers every sequence's context into a padded ``[B, max_ctx, Hkv, D]`` copy and calls
SDPA with a mask: three passes over the KV bytes plus the padding, but it runs on any
device and dtype (CUDA included). Prefill stays with ``paged.paged_attention``'s SDPA.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from conveyor.model.attention.backend import AttentionBackend

if TYPE_CHECKING:
    from conveyor.model.attention.metadata import AttentionMetadata


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


sdpa_decode.needs_mask = True  # type: ignore[attr-defined]


class SdpaAttentionBackend(AttentionBackend):
    """Gather + padded ``scaled_dot_product_attention``: any device and dtype."""

    name = "sdpa"

    def decode_kernel(self) -> Callable:
        return sdpa_decode
