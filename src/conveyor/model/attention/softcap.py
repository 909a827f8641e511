"""Attention with soft-capped logits (Gemma 2: ``cap * tanh(scores / cap)`` before the mask
and softmax), over the paged cache.

Neither SDPA nor the native C kernels take a cap, so a layer with one comes here for its
decode rows and prefill segments alike: explicit matmuls in transformers' eager order
(scores scaled, capped, masked, softmax in float32, then P @ V), so float32 logits agree
to rounding. It runs on any device and dtype.
"""

from __future__ import annotations

import torch

from conveyor.model.attention.metadata import AttentionMetadata


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float, softcap: float) -> torch.Tensor:
    """q: [B, Hq, Lq, D]; k, v: [B, Hkv, Lk, D]; mask: bool broadcastable to
    [B, 1, Lq, Lk] (True = attend). Returns [B, Hq, Lq, D]."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    w = torch.matmul(q, k.transpose(2, 3)) * scale
    w = torch.tanh(w / softcap) * softcap
    w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
    w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(w, v)


def capped_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float,
                           softcap: float) -> torch.Tensor:
    """``paged.paged_attention``'s contract (the step's K/V already written to the cache)
    with capped logits: q [T, Hq, D] -> [T, Hq, D]."""
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        ks = k_cache[meta.decode_slots].transpose(1, 2)  # [B, Hkv, max_ctx, D]
        vs = v_cache[meta.decode_slots].transpose(1, 2)
        cols = torch.arange(ks.shape[2], device=q.device)
        lens = meta.decode_lens.to(q.device).long()
        starts = meta.decode_starts.to(q.device).long()
        mask = (cols[None, :] < lens[:, None]) & (cols[None, :] >= starts[:, None])
        o = capped_attention(q[:nd].unsqueeze(2), ks, vs, mask[:, None, None, :], scale,
                             softcap)
        out[:nd] = o.squeeze(2)
    for seg in meta.prefills:
        s, e = seg.start, seg.start + seg.length
        if seg.ctx_slots is None:
            ks, vs = k[s:e], v[s:e]
        else:
            ks, vs = k_cache[seg.ctx_slots], v_cache[seg.ctx_slots]
        mask = seg.mask
        if mask is None:  # a fresh prompt: plain causal over its own K/V
            mask = torch.ones(seg.length, ks.shape[0], dtype=torch.bool,
                              device=q.device).tril()
        o = capped_attention(q[s:e].transpose(0, 1).unsqueeze(0),
                             ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0),
                             mask, scale, softcap)
        out[s:e] = o[0].transpose(0, 1)
    return out
