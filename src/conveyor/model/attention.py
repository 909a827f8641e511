"""Attention over a paged KV cache for a flat, ragged batch.

A step's tokens are packed with decode requests (one query token each) first and
prefill chunks after:

    tokens:  [d0 d1 d2 ... d(B-1) | p0 p0 p0 p0 | p1 p1 ...]
             decode group          prefill segments, one per request

The cache of one layer is ``[num_slots, num_kv_heads, head_dim]`` with
``slot = block_id * block_size + offset``. New K/V are written at the step's slots
first, then every query reads its whole context through its slots: the decode
group in one padded ``scaled_dot_product_attention`` call (or the native decode kernel),
each prefill segment in its own call (a fresh prompt attends to its own K/V without
touching the cache, through the native prefill kernel on CPU where it applies: all the
fresh prompts of a layer in one call).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSegment:
    start: int  # first token of the segment in the flat batch
    length: int  # query tokens
    # Slots of the whole context (cached prefix + this chunk), or None for a fresh prompt
    # that attends to its own new K/V only.
    ctx_slots: torch.Tensor | None = None
    # [length, ctx_len] bool, True = attend; None means plain causal (fresh prompt).
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each token's K/V is written
    num_decodes: int = 0
    decode_slots: torch.Tensor | None = None  # [num_decodes, max_ctx] int64, padded
    decode_lens: torch.Tensor | None = None  # [num_decodes] int32 context lengths
    decode_starts: torch.Tensor | None = None  # [num_decodes] int32 first attended position
    decode_mask: torch.Tensor | None = None  # [num_decodes, max_ctx] bool (SDPA only)
    # One of decode_attention.py's kernels: (q, k_cache, v_cache, meta, scale) -> out.
    decode_kernel: Callable | None = None
    prefills: list[PrefillSegment] = field(default_factory=list)
    # For a fresh prompt's causal attention: (q, k, v, out, scale) -> True if it wrote
    # ``out`` (the native kernel), False to leave the segment to SDPA; None: SDPA always.
    # One with a ``varlen(q, k, v, out, segments, scale)`` method takes all the fresh
    # prompts of a layer in one call (segments: ``fresh_segments()``).
    prefill_kernel: Callable | None = None
    _fresh: torch.Tensor | None = field(default=None, init=False, repr=False)

    def fresh_segments(self) -> torch.Tensor:
        """[2, S] int32: the first rows and lengths of the fresh prompts (no cached
        prefix, no mask), built on the first layer's call and shared by the rest."""
        if self._fresh is None:
            fresh = [(p.start, p.length) for p in self.prefills
                     if p.ctx_slots is None and p.mask is None]
            self._fresh = torch.tensor(fresh, dtype=torch.int32).reshape(-1, 2).t().contiguous()
        return self._fresh


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [num_slots, Hkv, D]. Returns [T, Hq, D]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    nd = meta.num_decodes
    if nd and not meta.prefills:
        return meta.decode_kernel(q, k_cache, v_cache, meta, scale)
    gqa = q.shape[1] != k.shape[1]
    out = torch.empty_like(q)
    if nd:
        out[:nd] = meta.decode_kernel(q[:nd], k_cache, v_cache, meta, scale)
    varlen = getattr(meta.prefill_kernel, "varlen", None)
    fresh_done = varlen is not None and varlen(q, k, v, out, meta.fresh_segments(), scale)
    for seg in meta.prefills:
        s, e = seg.start, seg.start + seg.length
        if seg.ctx_slots is None and seg.mask is None and (fresh_done or (
                meta.prefill_kernel is not None
                and meta.prefill_kernel(q[s:e], k[s:e], v[s:e], out[s:e], scale))):
            continue
        qs = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, Hq, len, D]
        if seg.ctx_slots is None:
            ks, vs = k[s:e], v[s:e]  # [len, Hkv, D]
        else:
            ks, vs = k_cache[seg.ctx_slots], v_cache[seg.ctx_slots]  # [ctx, Hkv, D]
        ks = ks.transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
        vs = vs.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=seg.mask, is_causal=seg.mask is None, scale=scale,
            enable_gqa=gqa)
        out[s:e] = o[0].transpose(0, 1)
    return out
