"""Decode attention that reads the paged KV cache in place (CPU, compiled by inductor).

The eager path gathers every decode request's context into a padded
``[B, max_ctx, Hkv, D]`` copy per layer and hands it to SDPA: three passes over
the KV bytes plus the padding. Written as broadcast-multiply-and-reduce, the
same math lets inductor fuse the gather into the reductions: each K/V row is
loaded once, straight from its slot, and padded positions all point at slot 0
(one cached row) before the mask drops them.

    scores[b, t, h, g] = sum_d q[b, h, g, d] * K[slots[b, t], h, d]   (h: KV head,
    p = softmax over t (masked)                                         g: query head
    out[b, h, g, d]    = sum_t p[b, t, h, g] * V[slots[b, t], h, d]     in its group)
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               slots: torch.Tensor, mask: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """q: [B, Hq, D]; caches: [num_slots, Hkv, D]; slots, mask: [B, L]. Returns [B, Hq, D]."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    length = slots.shape[1]
    qg = q.float().view(b, 1, hkv, hq // hkv, d)
    k = k_cache[slots].float().unsqueeze(3)  # [B, L, Hkv, 1, D]
    scores = (qg * k).sum(-1) * scale  # [B, L, Hkv, G]
    scores = scores.masked_fill(~mask.view(b, length, 1, 1), float("-inf"))
    p = torch.softmax(scores, dim=1)
    v = v_cache[slots].float().unsqueeze(3)  # [B, L, Hkv, 1, D]
    out = (p.unsqueeze(-1) * v).sum(1)  # [B, Hkv, G, D]
    return out.reshape(b, hq, d).to(q.dtype)


_compiled = None


def compiled_decode_attention():
    """The inductor-compiled kernel (one compile per head layout and dtype, then cached)."""
    global _compiled
    if _compiled is None:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _compiled = torch.compile(decode_attention_reference, dynamic=True, fullgraph=True)
    return _compiled


def warm_up(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
            device: torch.device) -> bool:
    """Compile for this model's head layout (batch 1 and >1 specialize); False if it fails."""
    fn = compiled_decode_attention()
    try:
        for batch, length in ((1, 3), (3, 5)):
            q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device)
            cache = torch.randn(16, num_kv_heads, head_dim, dtype=dtype, device=device)
            slots = torch.arange(length, device=device).repeat(batch, 1)
            mask = torch.ones(batch, length, dtype=torch.bool, device=device)
            fn(q, cache, cache, slots, mask, head_dim ** -0.5)
    except Exception as e:  # no C++ compiler, unsupported platform, ...
        logger.warning("compiled decode attention unavailable (%s); using SDPA", e)
        return False
    return True
