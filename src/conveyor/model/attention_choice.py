"""The attention backend chosen by measurement on the machine at hand.

As with the linears (``linear_choice.py``): a kernel that wins on one CPU may lose on
the next (the native kernels are written for AVX2/AVX-512; on a CPU without them the C
is portable and torch's SDPA may be the faster). So ``attention_backend="auto"`` times
every registered backend that supports the model, on the model's own heads, at one
decode call (``max_num_seqs`` sequences over a paged cache of ``DECODE_CONTEXT``
tokens each) plus one fresh-prompt prefill call (``PREFILL_TOKENS``), and keeps the
fastest. The choice is cached per CPU model, flags, torch version, threads, dtype,
heads and row counts (``<cache>/attention_choice.json``), logged, and
``--attention-backend NAME`` still forces one; ``CONVEYOR_MEASURE_ATTENTION=0`` keeps the
priority order.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from conveyor.model import choice_cache
from conveyor.model.attention import AttentionMetadata
from conveyor.model.dtypes import cpu_model_name

logger = logging.getLogger(__name__)

DECODE_CONTEXT = 256
PREFILL_TOKENS = 256
_BLOCK = 16


def measuring_enabled() -> bool:
    return choice_cache.switched_on("CONVEYOR_MEASURE_ATTENTION")


@torch.inference_mode()
def measure(backends: dict[str, object], device: torch.device, dtype: torch.dtype,
            num_heads: int, num_kv_heads: int, head_dim: int, decode_rows: int
            ) -> dict[str, float]:
    """Seconds per backend name: one decode call plus one fresh-prompt prefill call."""
    gen = torch.Generator().manual_seed(0)
    b, ctx, t = decode_rows, DECODE_CONTEXT, PREFILL_TOKENS
    slots_per_seq = -(-ctx // _BLOCK) * _BLOCK
    cache_shape = (b * slots_per_seq, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(device=device, dtype=dtype)
    q = torch.randn(b, num_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    slots = (torch.arange(b).unsqueeze(1) * slots_per_seq + torch.arange(ctx)).to(device)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
    starts = torch.zeros(b, dtype=torch.int32, device=device)
    qkv = torch.randn(t, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(
        device=device, dtype=dtype)
    qs = qkv[:, :num_heads * head_dim].view(t, num_heads, head_dim)
    ks = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(
        t, num_kv_heads, head_dim)
    vs = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(t, num_kv_heads, head_dim)
    scale = head_dim ** -0.5
    out: dict[str, float] = {}
    for name, backend in backends.items():
        decode, prefill = backend.decode_kernel(), backend.prefill_kernel()
        meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long, device=device),
                                 num_decodes=b, decode_slots=slots, decode_lens=lens,
                                 decode_starts=starts)
        if getattr(decode, "needs_mask", False):
            meta.decode_mask = torch.ones(b, ctx, dtype=torch.bool, device=device)

        def run_prefill(prefill=prefill) -> None:
            o = torch.empty_like(qs)
            if prefill is not None and prefill(qs, ks, vs, o, scale):
                return
            F.scaled_dot_product_attention(
                qs.transpose(0, 1).unsqueeze(0), ks.transpose(0, 1).unsqueeze(0),
                vs.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
                enable_gqa=num_heads != num_kv_heads)

        out[name] = (choice_cache.best_of(lambda decode=decode, meta=meta:
                                          decode(q, k_cache, v_cache, meta, scale))
                     + choice_cache.best_of(run_prefill))
    return out


def _cache_key(dtype: torch.dtype, heads: tuple[int, int, int], rows: int,
               candidates: list[str]) -> str:
    return choice_cache.key(str(dtype), repr(heads), str(rows), ",".join(candidates),
                            f"{DECODE_CONTEXT},{PREFILL_TOKENS}")


def choose(backends: dict[str, object], device: torch.device, dtype: torch.dtype,
           num_heads: int, num_kv_heads: int, head_dim: int, decode_rows: int) -> str:
    """The fastest backend's name, from the cache or measured now."""
    names = list(backends)
    rows = max(1, min(decode_rows, 256))
    key = _cache_key(dtype, (num_heads, num_kv_heads, head_dim), rows, names)
    entry = choice_cache.read("attention").get(key)
    if entry is not None and entry.get("choice") in names:
        logger.info("attention backend (cached for this CPU): %s", entry["choice"])
        return entry["choice"]
    t0 = time.perf_counter()
    timings = measure(backends, device, dtype, num_heads, num_kv_heads, head_dim, rows)
    choice = min(timings, key=timings.get)
    logger.info("attention backend measured in %.1f s on %s (%d decode rows x %d context, "
                "a %d-token prefill): %s; ms: %s", time.perf_counter() - t0, cpu_model_name(),
                rows, DECODE_CONTEXT, PREFILL_TOKENS, choice,
                {n: round(1e3 * v, 3) for n, v in timings.items()})
    choice_cache.store("attention", key, {"choice": choice, "cpu": cpu_model_name(),
                                          "timings_s": timings})
    return choice
