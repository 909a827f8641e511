"""The attention backend chosen by measurement on the machine at hand.

As with the linears (``linears.py``): a kernel that wins on one CPU may lose on the next
(the native kernels are written for AVX2/AVX-512; on a CPU without them the C is
portable and torch's SDPA may be the faster). So ``attention_backend="auto"`` times
every registered backend that supports the model, on the model's own heads, at one
decode call (``max_num_seqs`` sequences over a paged cache of ``DECODE_CONTEXT`` tokens
each) plus one fresh-prompt prefill call (``PREFILL_TOKENS``), and keeps the fastest. A
backend's own prefill kernel is kept only where it beats SDPA on that prompt: its decode
kernel may win while its prefill loses. The choice is cached per CPU model, flags, torch
version, threads, dtype, heads, row counts and native kernel build
(``<cache>/attention_choice.json``), logged, and ``--attention-backend NAME`` still
forces one (with its prefill kernel); ``CONVEYOR_MEASURE_ATTENTION=0`` keeps the
priority order.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from conveyor import envs
from conveyor.kernels.cpu.cpuinfo import cpu_model_name
from conveyor.model.attention.metadata import AttentionMetadata
from conveyor.model.autotune import cache as choice_cache

logger = logging.getLogger(__name__)

DECODE_CONTEXT = 256
PREFILL_TOKENS = 256
_BLOCK = 16


def measuring_enabled() -> bool:
    return envs.switched_on(envs.MEASURE_ATTENTION)


@torch.inference_mode()
def measure(backends: dict[str, object], device: torch.device, dtype: torch.dtype,
            num_heads: int, num_kv_heads: int, head_dim: int, decode_rows: int
            ) -> dict[str, dict[str, float]]:
    """Seconds per backend name: one decode call (``decode``), one fresh-prompt prefill
    through its own prefill kernel (``prefill``, absent without one) and through SDPA
    (``sdpa_prefill``, the same for every backend: measured once)."""
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

    def sdpa_prefill() -> None:
        F.scaled_dot_product_attention(
            qs.transpose(0, 1).unsqueeze(0), ks.transpose(0, 1).unsqueeze(0),
            vs.transpose(0, 1).unsqueeze(0), is_causal=True, scale=scale,
            enable_gqa=num_heads != num_kv_heads)

    sdpa_s = choice_cache.best_of(sdpa_prefill)
    out: dict[str, dict[str, float]] = {}
    for name, backend in backends.items():
        decode, prefill = backend.decode_kernel(), backend.prefill_kernel()
        meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long, device=device),
                                 num_decodes=b, decode_slots=slots, decode_lens=lens,
                                 decode_starts=starts)
        if getattr(decode, "needs_mask", False):
            meta.decode_mask = torch.ones(b, ctx, dtype=torch.bool, device=device)
        out[name] = {"decode": choice_cache.best_of(
            lambda decode=decode, meta=meta: decode(q, k_cache, v_cache, meta, scale)),
            "sdpa_prefill": sdpa_s}
        o = torch.empty_like(qs)
        if prefill is not None and prefill(qs, ks, vs, o, scale):  # it takes this prompt
            out[name]["prefill"] = choice_cache.best_of(
                lambda prefill=prefill: prefill(qs, ks, vs, torch.empty_like(qs), scale))
    return out


def best_total(times: dict[str, float]) -> tuple[float, bool]:
    """(seconds, whether its own prefill kernel is kept): decode plus the faster prefill."""
    own = times.get("prefill")
    keep = own is not None and own <= times["sdpa_prefill"]
    return times["decode"] + (own if keep else times["sdpa_prefill"]), keep


def _cache_key(dtype: torch.dtype, heads: tuple[int, int, int], rows: int,
               candidates: list[str]) -> str:
    return choice_cache.key(str(dtype), repr(heads), str(rows), ",".join(candidates),
                            f"{DECODE_CONTEXT},{PREFILL_TOKENS}", choice_cache.kernel_build())


def choose(backends: dict[str, object], device: torch.device, dtype: torch.dtype,
           num_heads: int, num_kv_heads: int, head_dim: int, decode_rows: int
           ) -> tuple[str, bool]:
    """(the fastest backend's name, whether its own prefill kernel beats SDPA), from the
    cache or measured now."""
    names = list(backends)
    rows = max(1, min(decode_rows, 256))
    key = _cache_key(dtype, (num_heads, num_kv_heads, head_dim), rows, names)
    entry = choice_cache.read("attention").get(key)
    if entry is not None and entry.get("choice") in names:
        logger.info("attention backend (cached for this CPU): %s%s", entry["choice"],
                    "" if entry.get("prefill_kernel", True) else ", SDPA for prefill")
        return entry["choice"], bool(entry.get("prefill_kernel", True))
    t0 = time.perf_counter()
    timings = measure(backends, device, dtype, num_heads, num_kv_heads, head_dim, rows)
    totals = {n: best_total(t) for n, t in timings.items()}
    choice = min(totals, key=lambda n: totals[n][0])
    keep = totals[choice][1]
    logger.info("attention backend measured in %.1f s on %s (%d decode rows x %d context, "
                "a %d-token prefill): %s%s; ms: %s", time.perf_counter() - t0,
                cpu_model_name(), rows, DECODE_CONTEXT, PREFILL_TOKENS, choice,
                "" if keep or "prefill" not in timings[choice] else
                " (its prefill kernel loses to SDPA here: SDPA for prefill)",
                {n: {k: round(1e3 * v, 3) for k, v in t.items()} for n, t in timings.items()})
    choice_cache.store("attention", key, {"choice": choice, "prefill_kernel": keep,
                                          "cpu": cpu_model_name(), "timings_s": timings})
    return choice, keep
