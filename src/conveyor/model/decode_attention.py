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
    """The inductor-compiled kernel, one graph for every batch size and context length.

    Batch, context and pool sizes are marked unbacked, so the graph is never
    specialized on them (no recompile for a batch of 1, a 1-token context or a
    context past inductor's long-reduction threshold): one compile per head layout
    and dtype, done at warm-up.
    """
    global _compiled
    if _compiled is None:
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        _compiled = torch.compile(decode_attention_reference, dynamic=True, fullgraph=True)
    return _call_unbacked


def _call_unbacked(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slots: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    from torch._dynamo.decorators import mark_unbacked

    for t in (q, k_cache, v_cache):
        mark_unbacked(t, 0)
    for t in (slots, mask):
        mark_unbacked(t, 0)
        mark_unbacked(t, 1)
    return _compiled(q, k_cache, v_cache, slots, mask, scale)


def warm_up(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
            device: torch.device) -> bool:
    """Compile for this model's head layout and dtype; False if compiling fails."""
    fn = compiled_decode_attention()
    try:
        # Compiled guards check grad mode and tensor kinds: mimic the runner, whose KV
        # cache is an ordinary tensor and whose per-step inputs come from inference mode.
        k_cache, v_cache = (torch.randn(64, num_kv_heads, head_dim, dtype=dtype, device=device)
                            for _ in range(2))
        with torch.inference_mode():
            q = torch.randn(3, num_heads, head_dim, dtype=dtype, device=device)
            slots = torch.arange(33, device=device).repeat(3, 1)
            mask = torch.ones(3, 33, dtype=torch.bool, device=device)
            fn(q, k_cache, v_cache, slots, mask, head_dim ** -0.5)
    except Exception as e:  # no C++ compiler, unsupported platform, ...
        logger.warning("compiled decode attention unavailable (%s); using SDPA", e)
        return False
    return True
