"""Attention with soft-capped logits (Gemma 2: ``cap * tanh(scores / cap)`` before the mask
and softmax), over the paged cache.

SDPA takes no cap, so a capped layer comes here for what the backend's kernels do not
take (``paged.py``: everything where the decode kernel takes no cap, as on SDPA and with
the native kernels off; on the native backend only the segments its prefill kernel
declines, such as a chunk over a cached prefix): explicit matmuls in transformers' eager order
(scores scaled, capped, masked, softmax in float32, then P @ V), so float32 logits agree
to rounding. It runs on any device and dtype.

A KV head's query heads (GQA) share one copy of its K and V: they are the rows of one
product ([G * Lq, D] @ [D, Lk]), never a K/V repeated per query head. Decode rows gather
their context from the cache once per layer, laid out [Hkv, B, L, D] by the gather itself,
and only the columns some row attends (a windowed layer's rows start past the window).
"""

from __future__ import annotations

import torch

from conveyor.model.attention.metadata import AttentionMetadata


def _capped_softmax(w: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float,
                    dtype: torch.dtype) -> torch.Tensor:
    """Scores scaled, capped, masked (``mask`` broadcast, True = attend) and
    softmax-ed in float32, back in ``dtype``."""
    w = w * scale
    w = torch.tanh(w / softcap) * softcap
    w = w.masked_fill(~mask, torch.finfo(w.dtype).min)
    return torch.softmax(w, dim=-1, dtype=torch.float32).to(dtype)


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float, softcap: float) -> torch.Tensor:
    """One sequence: q [Lq, Hq, D]; k, v [Lk, Hkv, D]; mask bool [Lq, Lk] (True = attend).
    Returns [Lq, Hq, D]."""
    lq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    # [Hkv, G * Lq, D]: query head h reads KV head h // G
    qg = q.reshape(lq, hkv, g, d).permute(1, 2, 0, 3).reshape(hkv, g * lq, d)
    w = torch.matmul(qg, k.permute(1, 2, 0))  # [Hkv, G * Lq, Lk]
    p = _capped_softmax(w.view(hkv, g, lq, -1), mask, scale, softcap, q.dtype)
    o = torch.matmul(p.view(hkv, g * lq, -1), v.transpose(0, 1))  # [Hkv, G * Lq, D]
    return o.view(hkv, g, lq, d).permute(2, 0, 1, 3).reshape(lq, hq, d)


def capped_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, softcap: float) -> torch.Tensor:
    """The decode rows: q [B, Hq, D] -> [B, Hq, D], each row over its context's slots."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    lens = meta.decode_lens.to(q.device).long()
    starts = meta.decode_starts.to(q.device).long()
    lo, hi = int(starts.min()), int(lens.max())  # columns no row attends stay out
    slots = meta.decode_slots[:, lo:hi]
    ks = k_cache.transpose(0, 1)[:, slots]  # [Hkv, B, L, D]
    vs = v_cache.transpose(0, 1)[:, slots]
    cols = torch.arange(lo, hi, device=q.device)
    mask = (cols[None, :] < lens[:, None]) & (cols[None, :] >= starts[:, None])  # [B, L]
    qg = q.view(b, hkv, g, d).transpose(0, 1)  # [Hkv, B, G, D]
    w = torch.matmul(qg, ks.transpose(2, 3))  # [Hkv, B, G, L]
    p = _capped_softmax(w, mask[None, :, None, :], scale, softcap, q.dtype)
    o = torch.matmul(p, vs)  # [Hkv, B, G, D]
    return o.transpose(0, 1).reshape(b, hq, d)


def capped_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float,
                           softcap: float) -> torch.Tensor:
    """``paged.paged_attention``'s contract (the step's K/V already written to the cache)
    with capped logits: q [T, Hq, D] -> [T, Hq, D]."""
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = capped_decode(q[:nd], k_cache, v_cache, meta, scale, softcap)
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
        out[s:e] = capped_attention(q[s:e], ks, vs, mask, scale, softcap)
    return out
