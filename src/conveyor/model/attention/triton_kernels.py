"""Triton kernels of the ``triton`` attention backend: the KV write and one unified
attention kernel for decode rows and prefill chunks over the paged cache.

The kernels are plain functions here, wrapped by ``triton.jit`` on first use
(``kernels()``): compiled for CUDA, or run by Triton's interpreter on the CPU where
``TRITON_INTERPRET=1`` was set before triton was imported (its standard library is
wrapped at import). ``scripts/triton_compile_check.py`` compiles every entry of
``KERNELS`` for real GPU targets.

Layout (``paged.py``): a cache is ``[num_slots, Hkv, D]``; every sequence of the step has
a row of the slot table (``[S, W]`` int64, the cache slot of each context position: a page
table of page size 1, so any block size works), its first query row in the flat batch,
its query length and its context length (cached prefix + this step's tokens). Query ``t``
of a sequence sits at position ``ctx - q_len + t`` and attends to the keys at positions
``max(kv_lo, pos - window + 1) ..= pos`` (causal, optional sliding window).
"""

from __future__ import annotations

import functools

import torch

try:  # triton is optional: the backend's ``supports`` says so where it is missing
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is not installed
    triton = tl = None


def _write_kv(K, V, K_CACHE, V_CACHE, SLOTS, stride_kt, stride_kh, stride_vt, stride_vh,
              stride_cs, stride_ch, stride_vcs, stride_vch,
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (token, KV head): its K and V rows copied to its slot (none for a
    negative slot: the padding rows of a CUDA graph's batch)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(SLOTS + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < tl.where(slot >= 0, HEAD_DIM, 0)
    k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=d_ok)
    v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=d_ok)
    tl.store(K_CACHE + slot * stride_cs + h * stride_ch + d, k, mask=d_ok)
    tl.store(V_CACHE + slot * stride_vcs + h * stride_vch + d, v, mask=d_ok)


def _unified_attention(Q, K_CACHE, V_CACHE, OUT, SLOT_TABLE, Q_START, Q_LEN, CTX_LEN, KV_LO,
                       scale, softcap, window,
                       stride_qt, stride_qh, stride_kcs, stride_kch, stride_vcs, stride_vch,
                       stride_ot, stride_oh, stride_st,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
                       GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                       IEEE: tl.constexpr):
    """One program per (sequence, tile of BLOCK_Q query tokens, KV head); its rows are the
    tile's tokens times the GROUP query heads that share the KV head (GQA: each K/V tile
    is loaded once for all of them). Online softmax in float32 (scores, max, sum, the
    accumulator); P is cast to V's dtype for the second product, as flash attention does.
    ``softcap`` > 0 caps the scaled scores at ``softcap * tanh(s / softcap)``; ``window``
    > 0 keeps the last ``window`` positions."""
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kvh = tl.program_id(2)
    q_len = tl.load(Q_LEN + seq)
    q0 = tl.load(Q_START + seq)
    ctx = tl.load(CTX_LEN + seq)
    kv_lo = tl.load(KV_LO + seq)
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    rows = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_Q + rows // GROUP_P
    hq = rows % GROUP_P
    row_ok = (tok < q_len) & (hq < GROUP)
    head = kvh * GROUP + hq
    qpos = ctx - q_len + tok
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = (q0 + tok).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # Keys this tile can see: up to its last query, from the window of its first query.
    first = ctx - q_len + tile * BLOCK_Q
    hi = tl.minimum(ctx, first + BLOCK_Q)
    hi = tl.where(tile * BLOCK_Q < q_len, hi, 0)
    lo = kv_lo
    if window > 0:
        lo = tl.maximum(lo, first - window + 1)
    lo = (lo // BLOCK_N) * BLOCK_N
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        slots = tl.load(SLOT_TABLE + seq * stride_st + n, mask=n_ok, other=0).to(tl.int64)
        k = tl.load(K_CACHE + slots[:, None] * stride_kcs + kvh * stride_kch + d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        if softcap > 0:  # tanh through exp: the interpreter and every target have exp
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        allowed = n_ok[None, :] & (n[None, :] <= qpos[:, None]) & (n[None, :] >= kv_lo)
        if window > 0:
            allowed = allowed & (n[None, :] > qpos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        denom = denom * alpha + tl.sum(p, 1)
        v = tl.load(V_CACHE + slots[:, None] * stride_vcs + kvh * stride_vch + d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(OUT + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


KERNELS = {"write_kv": _write_kv, "unified_attention": _unified_attention}


@functools.cache
def kernels() -> dict:
    """``KERNELS`` through ``triton.jit``: compiled on CUDA, interpreted under
    ``TRITON_INTERPRET=1``."""
    if triton is None:
        raise RuntimeError("triton is not installed (pip install 'conveyor[triton]')")
    return {name: triton.jit(fn) for name, fn in KERNELS.items()}


def interpreted() -> bool:
    """Whether triton runs its kernels in the interpreter in this process (the CPU path):
    ``TRITON_INTERPRET=1`` must have been set before triton's import."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.zeros, InterpretedFunction)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] (last dim contiguous) written at ``slot_mapping`` [T]."""
    t, hkv, d = k.shape
    if t == 0:
        return
    kernels()["write_kv"][(t, hkv)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), HEAD_DIM=d, BLOCK_D=max(16, _pow2(d)))


def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      out: torch.Tensor, slot_table: torch.Tensor, q_start: torch.Tensor,
                      q_len: torch.Tensor, ctx_len: torch.Tensor, kv_lo: torch.Tensor,
                      max_q_len: int, scale: float, softcap: float = 0.0, window: int = 0,
                      block_n: int | None = None) -> None:
    """Attention of every sequence of the step into ``out`` [T, Hq, D]; the per-sequence
    tensors are int32 [S], ``slot_table`` int64 [S, W]."""
    s = slot_table.shape[0]
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[1]
    if s == 0:
        return
    group = hq // hkv
    group_p = _pow2(group)
    block_q = max(1, 16 // group_p)  # tl.dot needs 16 rows at least
    if block_n is None:
        block_n = 16 if q.device.type == "cpu" else 64
    grid = (s, -(-max_q_len // block_q), hkv)
    kernels()["unified_attention"][grid](
        q, k_cache, v_cache, out, slot_table, q_start, q_len, ctx_len, kv_lo,
        float(scale), float(softcap), int(window),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
        v_cache.stride(1), out.stride(0), out.stride(1), slot_table.stride(0),
        HEAD_DIM=d, BLOCK_D=max(16, _pow2(d)), GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q,
        BLOCK_N=block_n, IEEE=q.dtype == torch.float32)
