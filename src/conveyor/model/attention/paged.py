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
fresh prompts of a layer in one call). Soft-capped layers (Gemma 2) take the same route
where the kernels take the cap, ``softcap.py``'s explicit products where not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from conveyor.model.attention.metadata import AttentionMetadata
from conveyor.model.attention.softcap import capped_attention, capped_paged_attention


def _takes_cap(kernel) -> bool:
    """Whether a decode or prefill kernel takes ``softcap=`` (the native C kernels)."""
    return getattr(kernel, "takes_softcap", False)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float,
                    softcap: float | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [num_slots, Hkv, D]. Returns [T, Hq, D].
    ``softcap``: logits capped at that (Gemma 2). A backend with one kernel for the whole
    layer (``unified``: triton) takes the cap and the metadata's window itself; the native
    C kernels take it (``takes_softcap``) for the decode rows and fresh prompts, and
    ``softcap.py`` computes what they do not cover (every part where the decode kernel
    takes no cap: SDPA's, the native-kernels-off path)."""
    unified = getattr(meta.decode_kernel, "unified", None)  # one kernel for the whole layer
    if unified is not None:
        return unified(q, k, v, k_cache, v_cache, meta, scale, softcap=softcap)
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    capped = {}
    if softcap is not None:
        if not _takes_cap(meta.decode_kernel):
            return capped_paged_attention(q, k, v, k_cache, v_cache, meta, scale, softcap)
        capped = {"softcap": softcap}
    nd = meta.num_decodes
    if nd and not meta.prefills:
        return meta.decode_kernel(q, k_cache, v_cache, meta, scale, **capped)
    gqa = q.shape[1] != k.shape[1]
    out = torch.empty_like(q)
    if nd:
        out[:nd] = meta.decode_kernel(q[:nd], k_cache, v_cache, meta, scale, **capped)
    prefill_kernel = meta.prefill_kernel
    if capped and not _takes_cap(prefill_kernel):
        prefill_kernel = None
    varlen = getattr(prefill_kernel, "varlen", None)
    fresh_done = varlen is not None and varlen(q, k, v, out, meta.fresh_segments(), scale,
                                               **capped)
    for seg in meta.prefills:
        s, e = seg.start, seg.start + seg.length
        if seg.ctx_slots is None and seg.mask is None and (fresh_done or (
                prefill_kernel is not None
                and prefill_kernel(q[s:e], k[s:e], v[s:e], out[s:e], scale, **capped))):
            continue
        if seg.ctx_slots is None:
            ks, vs = k[s:e], v[s:e]  # [len, Hkv, D]
        else:
            ks, vs = k_cache[seg.ctx_slots], v_cache[seg.ctx_slots]  # [ctx, Hkv, D]
        if capped:
            mask = seg.mask
            if mask is None:  # a fresh prompt: plain causal over its own K/V
                mask = torch.ones(seg.length, ks.shape[0], dtype=torch.bool,
                                  device=q.device).tril()
            out[s:e] = capped_attention(q[s:e], ks, vs, mask, scale, softcap)
            continue
        qs = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, Hq, len, D]
        ks = ks.transpose(0, 1).unsqueeze(0)  # [1, Hkv, ctx, D]
        vs = vs.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=seg.mask, is_causal=seg.mask is None, scale=scale,
            enable_gqa=gqa)
        out[s:e] = o[0].transpose(0, 1)
    return out
