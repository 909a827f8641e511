"""Checked entry points to the native kernels: every ctypes function used from Python.

The C functions take raw pointers and sizes, so a tensor of the wrong dtype, device,
layout or shape would make them read or write the wrong memory (a crash at best). Each
function here checks dtype, device (CPU), strides and shapes first and raises a
``ValueError`` naming the op, the argument and what is wrong; only then does it hand the
pointers over. ``RuntimeError`` if the kernels are not built (``kernels.why_unavailable``).

They are also registered as torch operators, ``torch.ops.conveyor.<name>`` (a
``torch.library`` fragment with the same checked function as the kernel for every
backend, so a CUDA or meta tensor gets the same clear error). The engine's hot path calls
the Python functions directly, because the dispatcher costs more than the checks (at
decode batch sizes a call's dispatch is a visible share of its time). ``PackedGemm``
checks its packed weight once and only the input on each call.

Not checked: the values of index tensors (decode slots, lengths and starts, RoPE
positions) against the buffers they index; that would cost a reduction per call, and
the engine builds them itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import torch

from conveyor.kernels import cpu as kernels

_INT_MAX = 2**31 - 1
_lib = None  # the loaded library, once a call has needed it
_gemm_ok: bool | None = None
_packed_sizes: dict[tuple[int, int, bool], int] = {}


def _native():
    global _lib
    if _lib is None:
        lib = kernels.load()
        if lib is None:
            raise RuntimeError("the native kernels are unavailable " + kernels.why_unavailable())
        _lib = lib
    return _lib


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _argument_error(t, dtypes: tuple, ndim: int, layout: str):
    """What is wrong with one argument, or None. ``layout``: ``contiguous``, ``rows``
    (unit stride in the last dim) or ``heads`` ([T, H, D] with each row's heads
    contiguous)."""
    if not isinstance(t, torch.Tensor):
        return f"must be a tensor, got {type(t).__name__}"
    if not t.is_cpu:
        return f"must be a CPU tensor, got one on {t.device}"
    if t.dtype not in dtypes:
        return f"must be {' or '.join(map(_dtype_name, dtypes))}, got {_dtype_name(t.dtype)}"
    if t.dim() != ndim:
        return f"must have {ndim} dimensions, got shape {tuple(t.shape)}"
    if layout == "contiguous" and not t.is_contiguous():
        return f"must be contiguous, got shape {tuple(t.shape)} with strides {tuple(t.stride())}"
    if layout == "rows" and t.stride(-1) != 1:
        return f"must have unit stride in its last dimension, got strides {tuple(t.stride())}"
    if layout == "heads" and (t.stride(2) != 1 or t.stride(1) != t.shape[2]):
        return (f"must have each row's heads contiguous (strides (any, {t.shape[2]}, 1)), "
                f"got strides {tuple(t.stride())}")
    return None


def _refuse(op: str, args: tuple, shapes: Callable[[], str]) -> ValueError:
    """The ValueError for a call that failed its fast check: the first bad argument of
    ``args`` ((name, value, dtypes, ndim, layout) each), else ``shapes()``."""
    for name, t, dtypes, ndim, layout in args:
        what = _argument_error(t, dtypes, ndim, layout)
        if what is not None:
            return ValueError(f"conveyor::{op}: {name} {what}")
    return ValueError(f"conveyor::{op}: {shapes()}")


F32, BF16, I32, I64 = torch.float32, torch.bfloat16, torch.int32, torch.int64
_F32, _I32, _I64, _KV = (F32,), (I32,), (I64,), (F32, BF16)
_ACT = (F32, BF16)  # the elementwise ops' activations: float32, or bfloat16 (fp32 inside)

# Each op first evaluates one fast condition over all its arguments (attribute reads
# only: a call costs well under a microsecond more than the bare ctypes call); only when
# it fails does ``_refuse`` work out which argument is wrong and how.


# --- elementwise.c -------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` over the last dim of x [rows, dim] (float32, or bfloat16
    with x and weight alike)."""
    try:
        rows, dim = x.shape
        dt = x.dtype
        ok = ((dt is F32 or dt is BF16) and weight.dtype is dt and x.is_cpu
              and weight.is_cpu and x.is_contiguous() and weight.is_contiguous()
              and weight.shape == (dim,))
    except (AttributeError, ValueError):
        ok = False
    if not ok:
        raise _refuse("rms_norm", (("x", x, _ACT, 2, "contiguous"),
                                   ("weight", weight, _ACT, 1, "contiguous")),
                      lambda: f"weight has {weight.shape[0]} elements and dtype "
                              f"{_dtype_name(weight.dtype)}; x rows {x.shape[1]}, "
                              f"{_dtype_name(x.dtype)}")
    out = torch.empty_like(x)
    lib = _lib or _native()
    (lib.rms_norm_f32 if dt is F32 else lib.rms_norm_bf16)(
        x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, dim, eps)
    return out


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """``residual += x`` in place, returns ``rms_norm(residual)``; x, residual [rows, dim]."""
    try:
        rows, dim = shape = x.shape
        dt = x.dtype
        ok = ((dt is F32 or dt is BF16) and residual.dtype is dt and weight.dtype is dt
              and x.is_cpu and residual.is_cpu and weight.is_cpu and x.is_contiguous()
              and residual.is_contiguous() and weight.is_contiguous()
              and residual.shape == shape and weight.shape == (dim,))
    except (AttributeError, ValueError):
        ok = False
    if not ok:
        raise _refuse("add_rms_norm_", (("x", x, _ACT, 2, "contiguous"),
                                        ("residual", residual, _ACT, 2, "contiguous"),
                                        ("weight", weight, _ACT, 1, "contiguous")),
                      lambda: f"x {tuple(x.shape)}, residual {tuple(residual.shape)} and "
                              f"weight {tuple(weight.shape)} disagree (or their dtypes)")
    out = torch.empty_like(x)
    lib = _lib or _native()
    (lib.add_rms_norm_f32 if dt is F32 else lib.add_rms_norm_bf16)(
        x.data_ptr(), residual.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, dim, eps)
    return out


def silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """``silu(gate) * up`` of gate_up = [gate | up], [rows, 2 * intermediate]."""
    try:
        rows, cols = gate_up.shape
        dt = gate_up.dtype
        ok = ((dt is F32 or dt is BF16) and gate_up.is_cpu and gate_up.is_contiguous()
              and cols == 2 * intermediate)
    except (AttributeError, ValueError):
        ok = False
    if not ok:
        raise _refuse("silu_mul", (("gate_up", gate_up, _ACT, 2, "contiguous"),),
                      lambda: f"gate_up has {gate_up.shape[1]} columns, not 2 * intermediate "
                              f"= {2 * intermediate}")
    out = torch.empty((rows, intermediate), dtype=dt)
    lib = _lib or _native()
    (lib.silu_mul_f32 if dt is F32 else lib.silu_mul_bf16)(
        gate_up.data_ptr(), out.data_ptr(), rows, intermediate)
    return out


def gelu_tanh_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` of gate_up = [gate | up], [rows,
    2 * intermediate] float32 (Gemma's GeGLU)."""
    try:
        rows, cols = gate_up.shape
        ok = (gate_up.dtype is F32 and gate_up.is_cpu and gate_up.is_contiguous()
              and cols == 2 * intermediate)
    except (AttributeError, ValueError):
        ok = False
    if not ok:
        raise _refuse("gelu_tanh_mul", (("gate_up", gate_up, _F32, 2, "contiguous"),),
                      lambda: f"gate_up has {gate_up.shape[1]} columns, not 2 * intermediate "
                              f"= {2 * intermediate}")
    out = torch.empty((rows, intermediate), dtype=F32)
    (_lib or _native()).gelu_tanh_mul_f32(gate_up.data_ptr(), out.data_ptr(), rows, intermediate)
    return out


def softcap_(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``x = cap * tanh(x / cap)`` in place on a contiguous float32 tensor (Gemma 2's
    final logit soft-capping); returns x."""
    if not (isinstance(x, torch.Tensor) and x.dtype is F32 and x.is_cpu
            and x.is_contiguous()):
        raise ValueError("conveyor::softcap_: x must be a contiguous float32 CPU tensor")
    if not cap > 0.0:
        raise ValueError(f"conveyor::softcap_: cap must be > 0, got {cap}")
    (_lib or _native()).softcap_f32(x.data_ptr(), x.numel(), cap)
    return x


def rope_(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          heads: int, head_dim: int) -> None:
    """Neox RoPE in place on the first ``heads`` heads of each row of qkv [T, row]
    (rows may be strided); positions [T] int64 index the [max_pos, head_dim] tables."""
    try:
        t, row = qkv.shape
        _, table_dim = table = cos.shape
        dt = qkv.dtype
        ok = ((dt is F32 or dt is BF16) and positions.dtype is I64 and cos.dtype is F32
              and sin.dtype is F32 and qkv.is_cpu and positions.is_cpu and cos.is_cpu
              and sin.is_cpu and qkv.stride(1) == 1 and positions.is_contiguous()
              and cos.is_contiguous() and sin.is_contiguous() and positions.shape == (t,)
              and sin.shape == table and table_dim == head_dim and not head_dim % 2
              and 0 <= heads * head_dim <= row)
    except (AttributeError, ValueError):
        ok = False
    if not ok:
        raise _refuse("rope_", (("qkv", qkv, _ACT, 2, "rows"),
                                ("positions", positions, _I64, 1, "contiguous"),
                                ("cos", cos, _F32, 2, "contiguous"),
                                ("sin", sin, _F32, 2, "contiguous")),
                      lambda: f"qkv {tuple(qkv.shape)}, positions {tuple(positions.shape)}, "
                              f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} do not fit "
                              f"[T, row], [T], [max_pos, head_dim] x2 with {heads} heads of "
                              f"head_dim={head_dim} (even) in a row")
    lib = _lib or _native()
    (lib.rope_f32 if dt is F32 else lib.rope_bf16)(
        qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, heads,
        qkv.stride(0), head_dim)


# --- decode_attention.c, prefill_attention.c ------------------------------------------

def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, lens: torch.Tensor, starts: torch.Tensor,
                     scale: float, lib=None, softcap: float = 0.0) -> torch.Tensor:
    """One query token per sequence over a paged cache. q [B, Hq, D] float32; caches
    [num_slots, Hkv, D] float32 or bfloat16; slots [B, L] int64; lens, starts [B] int32.
    Returns float32 [B, Hq, D]. ``lib``: a library from ``kernels.load_variant`` instead
    of the process's own. ``softcap`` > 0: scaled scores capped at
    ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2)."""
    try:
        b, hq, d = q.shape
        _, hkv, kd = cache = k_cache.shape
        nb, ctx = slots.shape
        kdt = k_cache.dtype
        ok = (q.dtype is F32 and (kdt is F32 or kdt is BF16) and v_cache.dtype is kdt
              and slots.dtype is I64 and lens.dtype is I32 and starts.dtype is I32
              and q.is_cpu and k_cache.is_cpu and v_cache.is_cpu and slots.is_cpu
              and lens.is_cpu and starts.is_cpu and q.is_contiguous()
              and k_cache.is_contiguous() and v_cache.is_contiguous()
              and slots.is_contiguous() and lens.is_contiguous() and starts.is_contiguous()
              and v_cache.shape == cache and kd == d and hkv and not hq % hkv and nb == b
              and lens.shape == (b,) and starts.shape == (b,))
    except (AttributeError, ValueError):
        ok = False
    if not ok:
        kv = (getattr(k_cache, "dtype", None),) if getattr(k_cache, "dtype", None) in _KV \
            else _KV
        raise _refuse("decode_attention", (
            ("q", q, _F32, 3, "contiguous"), ("k_cache", k_cache, _KV, 3, "contiguous"),
            ("v_cache", v_cache, kv, 3, "contiguous"), ("slots", slots, _I64, 2, "contiguous"),
            ("lens", lens, _I32, 1, "contiguous"), ("starts", starts, _I32, 1, "contiguous")),
            lambda: f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache "
                    f"{tuple(v_cache.shape)}, slots {tuple(slots.shape)}, lens "
                    f"{tuple(lens.shape)} and starts {tuple(starts.shape)} do not fit "
                    "[B, Hq, D], [S, Hkv, D] x2 (Hkv dividing Hq), [B, L], [B], [B]")
    out = torch.empty((b, hq, d), dtype=F32)
    lib = lib or _lib or _native()
    _check_softcap("decode_attention", softcap)
    if softcap:
        fn = lib.decode_attention_f32_capped if kdt is F32 else lib.decode_attention_bf16_capped
        fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
           lens.data_ptr(), starts.data_ptr(), out.data_ptr(), b, hq, hkv, d, ctx, scale,
           softcap)
        return out
    fn = lib.decode_attention_f32 if kdt is F32 else lib.decode_attention_bf16
    fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), lens.data_ptr(),
       starts.data_ptr(), out.data_ptr(), b, hq, hkv, d, ctx, scale)
    return out


def _check_softcap(op: str, softcap: float) -> None:
    # NaN or a negative cap would silently mean "no cap" in C (softcap > 0 tests it).
    if not softcap >= 0.0:
        raise ValueError(f"conveyor::{op}: softcap must be >= 0 (0: none), got {softcap}")


# A one-byte cache's element types, by the kind number decode_attention.c takes (kv_quant.h).
KV_CODE_KINDS = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
_CODES = tuple(KV_CODE_KINDS)


def decode_attention_q8(q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor,
                        v_codes: torch.Tensor, v_scale: torch.Tensor, slots: torch.Tensor,
                        lens: torch.Tensor, starts: torch.Tensor, scale: float,
                        lib=None, softcap: float = 0.0) -> torch.Tensor:
    """``decode_attention`` over a one-byte cache (``model/quant/kv_cache.py``): codes
    [num_slots, Hkv, D] int8, float8_e4m3fn or float8_e5m2 (K and V alike), scales
    [num_slots, Hkv] float32; a value is its code times its scale, dequantised in the
    kernel. Returns float32 [B, Hq, D]."""
    try:
        b, hq, d = q.shape
        _, hkv, kd = cache = k_codes.shape
        nb, ctx = slots.shape
        kind = KV_CODE_KINDS.get(k_codes.dtype)
        ok = (kind is not None and q.dtype is F32 and v_codes.dtype is k_codes.dtype
              and k_scale.dtype is F32 and v_scale.dtype is F32
              and slots.dtype is I64 and lens.dtype is I32 and starts.dtype is I32
              and all(t.is_cpu and t.is_contiguous() for t in (
                  q, k_codes, v_codes, k_scale, v_scale, slots, lens, starts))
              and v_codes.shape == cache and k_scale.shape == cache[:2]
              and v_scale.shape == cache[:2] and kd == d and hkv and not hq % hkv
              and nb == b and lens.shape == (b,) and starts.shape == (b,))
    except (AttributeError, ValueError):
        ok = False
    if not ok:
        kv = (k_codes.dtype,) if getattr(k_codes, "dtype", None) in _CODES else _CODES
        raise _refuse("decode_attention_q8", (
            ("q", q, _F32, 3, "contiguous"), ("k_codes", k_codes, _CODES, 3, "contiguous"),
            ("v_codes", v_codes, kv, 3, "contiguous"),
            ("k_scale", k_scale, _F32, 2, "contiguous"),
            ("v_scale", v_scale, _F32, 2, "contiguous"),
            ("slots", slots, _I64, 2, "contiguous"),
            ("lens", lens, _I32, 1, "contiguous"), ("starts", starts, _I32, 1, "contiguous")),
            lambda: f"q {tuple(q.shape)}, codes {tuple(k_codes.shape)} and "
                    f"{tuple(v_codes.shape)}, scales {tuple(k_scale.shape)} and "
                    f"{tuple(v_scale.shape)}, slots {tuple(slots.shape)}, lens "
                    f"{tuple(lens.shape)} and starts {tuple(starts.shape)} do not fit "
                    "[B, Hq, D], [S, Hkv, D] x2 (Hkv dividing Hq), [S, Hkv] x2, [B, L], "
                    "[B], [B]")
    out = torch.empty((b, hq, d), dtype=F32)
    lib = lib or _lib or _native()
    _check_softcap("decode_attention_q8", softcap)
    args = (q.data_ptr(), k_codes.data_ptr(), v_codes.data_ptr(), k_scale.data_ptr(),
            v_scale.data_ptr(), slots.data_ptr(), lens.data_ptr(), starts.data_ptr(),
            out.data_ptr(), b, hq, hkv, d, ctx, scale, kind)
    if softcap:
        lib.decode_attention_q8_capped(*args, softcap)
    else:
        lib.decode_attention_q8(*args)
    return out


def kv_store_q8(x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor,
                scales: torch.Tensor, lib=None) -> None:
    """Quantize x [T, H, D] (float32 or bfloat16, each row's heads contiguous) into a
    one-byte cache at ``slots`` [T] int64: codes [num_slots, H, D] (``KV_CODE_KINDS``),
    scales [num_slots, H] float32, the bytes ``QuantizedKV``'s torch path writes."""
    try:
        t, h, d = x.shape
        kind = KV_CODE_KINDS.get(codes.dtype)
        ok = (kind is not None and (x.dtype is F32 or x.dtype is BF16) and x.is_cpu
              and x.stride(2) == 1 and x.stride(1) == d and slots.dtype is I64
              and slots.is_cpu and slots.is_contiguous() and slots.shape == (t,)
              and codes.is_cpu and codes.is_contiguous() and codes.shape[1:] == (h, d)
              and scales.dtype is F32 and scales.is_cpu and scales.is_contiguous()
              and scales.shape == codes.shape[:2])
    except (AttributeError, ValueError):
        ok = False
    if not ok:
        raise _refuse("kv_store_q8", (
            ("x", x, _ACT, 3, "heads"), ("slots", slots, _I64, 1, "contiguous"),
            ("codes", codes, _CODES, 3, "contiguous"),
            ("scales", scales, _F32, 2, "contiguous")),
            lambda: f"x {tuple(x.shape)}, slots {tuple(slots.shape)}, codes "
                    f"{tuple(codes.shape)} and scales {tuple(scales.shape)} do not fit "
                    "[T, H, D], [T], [S, H, D], [S, H]")
    if not t:
        return
    lib = lib or _lib or _native()
    lib.kv_store_q8(x.data_ptr(), x.stride(0), int(x.dtype is BF16), slots.data_ptr(), t, h,
                    d, codes.data_ptr(), scales.data_ptr(), kind)


def _heads_ok(t, dtype) -> bool:
    return (t.dtype is dtype and t.is_cpu and t.dim() == 3 and t.stride(2) == 1
            and t.stride(1) == t.shape[2])


def _prefill_ok(q, k, v, out, dt) -> bool:
    try:
        return ((dt is F32 or dt is BF16) and _heads_ok(q, dt) and _heads_ok(k, dt)
                and _heads_ok(v, dt) and _heads_ok(out, dt)
                and out.shape == q.shape and k.shape == v.shape and k.shape[0] == q.shape[0]
                and k.shape[2] == q.shape[2] and k.shape[1] > 0
                and not q.shape[1] % k.shape[1] and k.stride(0) == v.stride(0)
                and (q.shape[0] < 2 or out.stride(0) >= q.shape[1] * q.shape[2]))
    except AttributeError:
        return False


def _prefill_refusal(op: str, q, k, v, out, dt) -> ValueError:
    types = (dt,) if dt is F32 or dt is BF16 else _ACT
    return _refuse(op, tuple(
        (name, t, types, 3, "heads") for name, t in (("q", q), ("k", k), ("v", v),
                                                      ("out", out))),
        lambda: f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} and out "
                f"{tuple(out.shape)} (row strides {q.stride(0)}, {k.stride(0)}, "
                f"{v.stride(0)}, {out.stride(0)}) do not fit [T, Hq, D], [T, Hkv, D] x2 "
                "(Hkv dividing Hq, one row stride for k and v), [T, Hq, D] (rows apart)")


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      scale: float, lib=None, softcap: float = 0.0) -> bool:
    """Causal attention of a fresh prompt, written into ``out``: q, out [T, Hq, D], k, v
    [T, Hkv, D], all float32 or all bfloat16 (float32 sums either way, bf16 rounded on
    the way out, and for P @ V by the AVX-512 BF16 body: see
    ``kernels.bf16_prefill_rounds_probabilities``), rows strided as the packed QKV leaves
    them (k and v with the same row stride). False (nothing written) for a head dim the
    kernel has no copy for.
    ``lib``: a library from ``kernels.load_variant`` instead of the process's own.
    ``softcap`` > 0: scores capped as ``decode_attention``'s (the bf16 AMX body has no cap:
    a capped call runs the AVX-512 body)."""
    dt = getattr(q, "dtype", None)
    if not _prefill_ok(q, k, v, out, dt):
        raise _prefill_refusal("prefill_attention", q, k, v, out, dt)
    _check_softcap("prefill_attention", softcap)
    t_len, hq, d = q.shape
    lib = lib or _lib or _native()
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), t_len, hq, k.shape[1],
            d, q.stride(0), k.stride(0), out.stride(0), scale)
    if softcap:
        fn = lib.prefill_attention_f32_capped if dt is F32 else lib.prefill_attention_bf16_capped
        return fn(*args, softcap) == 0
    fn = lib.prefill_attention_f32 if dt is F32 else lib.prefill_attention_bf16
    return fn(*args) == 0


def prefill_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, segments: torch.Tensor, scale: float,
                             lib=None, softcap: float = 0.0) -> bool:
    """``prefill_attention`` of several fresh prompts of one flat batch in one call:
    ``segments`` [2, S] int32 holds each prompt's first row (row 0) and length (row 1) in
    q, k, v and out, whose other rows are neither read nor written. Unlike the other
    index tensors, its values are checked (each prompt inside the T rows, at least one
    row long): it costs a few microseconds a layer, not a reduction per token. Prompts
    should not overlap (their rows' outputs would race). False (nothing written) for a
    head dim the kernel has no copy for."""
    dt = getattr(q, "dtype", None)
    if not _prefill_ok(q, k, v, out, dt):
        raise _prefill_refusal("prefill_attention_varlen", q, k, v, out, dt)
    what = _argument_error(segments, _I32, 2, "contiguous")
    if what is None and segments.shape[0] != 2:
        what = f"must have shape [2, S], got {tuple(segments.shape)}"
    if what is not None:
        raise ValueError(f"conveyor::prefill_attention_varlen: segments {what}")
    t_len, hq, d = q.shape
    starts, lens = segments.numpy()
    if len(lens) and (lens.min() < 1 or starts.min() < 0
                      or (starts.astype(np.int64) + lens).max() > t_len):
        raise ValueError("conveyor::prefill_attention_varlen: segments must lie inside the "
                         f"{t_len} rows with lengths >= 1, got starts {starts.tolist()} and "
                         f"lengths {lens.tolist()}")
    _check_softcap("prefill_attention_varlen", softcap)
    lib = lib or _lib or _native()
    args = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), segments.data_ptr(),
            segments.data_ptr() + 4 * segments.shape[1], segments.shape[1], hq, k.shape[1], d,
            q.stride(0), k.stride(0), out.stride(0), scale)
    if softcap:
        fn = (lib.prefill_attention_varlen_f32_capped if dt is F32
              else lib.prefill_attention_varlen_bf16_capped)
        return fn(*args, softcap) == 0
    fn = lib.prefill_attention_varlen_f32 if dt is F32 else lib.prefill_attention_varlen_bf16
    return fn(*args) == 0


# --- gemm.c ---------------------------------------------------------------------------

def gemm_available() -> bool:
    """Whether the library has conveyor's GEMM (built only where the CPU has AVX2 + FMA)."""
    global _gemm_ok
    if _gemm_ok is None:
        _gemm_ok = bool(_native().gemm_f32_available())
    return _gemm_ok


def gemm_packed_size(out_features: int, in_features: int, gate_up: bool = False) -> int:
    """Floats in the packed layout of an [out_features, in_features] weight."""
    key = (out_features, in_features, bool(gate_up))
    size = _packed_sizes.get(key)
    if size is None:
        if not (0 < out_features <= _INT_MAX and 0 < in_features <= _INT_MAX):
            raise ValueError(f"conveyor::gemm: weight shape {(out_features, in_features)} "
                             "out of range")
        if gate_up and out_features % 2:
            raise ValueError("conveyor::gemm: a gate/up weight needs an even row count, got "
                             f"{out_features}")
        size = _packed_sizes[key] = int(_native().gemm_packed_size(out_features, in_features,
                                                                   int(gate_up)))
    return size


_W = (F32, BF16)  # packed weights: float32, or bfloat16 widened as the kernel loads them


def gemm_pack_weight(weight: torch.Tensor, gate_up: bool = False) -> torch.Tensor:
    """The packed layout of a float32 or bfloat16 [N, K] weight (gate_up: [gate; up] of 2I
    rows), in the weight's dtype: ``gemm`` computes in float32 either way."""
    try:
        ok = (weight.dtype in _W and weight.is_cpu and weight.dim() == 2
              and weight.is_contiguous())
    except (AttributeError, TypeError):
        ok = False
    if not ok:
        raise _refuse("gemm_pack_weight", (("weight", weight, _W, 2, "contiguous"),),
                      lambda: "bad weight")
    n, k = weight.shape
    size = gemm_packed_size(n, k, gate_up)
    # torch's CPU allocator aligns to 64 bytes, as the kernel's aligned loads need.
    packed = torch.empty(size, dtype=weight.dtype)
    pack = (_native().gemm_pack_weight_f32 if weight.dtype is F32
            else _native().gemm_pack_weight_bf16)
    pack(weight.data_ptr(), packed.data_ptr(), n, k, int(gate_up))
    return packed


def gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
         out_features: int, in_features: int, gate_up: bool = False,
         lib=None) -> torch.Tensor:
    """``x @ W.T + bias`` for x [M, K] float32 (rows may be strided, even overlap: x is
    only read) and W packed by ``gemm_pack_weight`` (float32 or bfloat16: float32
    arithmetic on the weight's exact values either way); gate_up: ``silu(gate) * up``,
    [M, N / 2]. ``lib``: a library from ``kernels.load_variant`` (with the GEMM built)
    instead of the process's own; every build packs alike."""
    size = (_packed_sizes.get((out_features, in_features, gate_up))
            or gemm_packed_size(out_features, in_features, gate_up))  # refuses bad shapes
    try:
        ok = (x.dtype is F32 and packed.dtype in _W and x.is_cpu
              and packed.is_cpu and x.dim() == 2 and packed.dim() == 1 and x.stride(1) == 1
              and packed.is_contiguous() and x.shape[1] == in_features
              and packed.shape[0] == size and not packed.data_ptr() % 64
              and x.stride(0) <= _INT_MAX
              and (bias is None or (not gate_up and bias.dtype is F32 and bias.is_cpu
                                    and bias.dim() == 1 and bias.is_contiguous()
                                    and bias.shape[0] == out_features)))
    except (AttributeError, TypeError):
        ok = False
    if not ok:
        args = [("x", x, _F32, 2, "rows"), ("packed", packed, _W, 1, "contiguous")]
        if bias is not None:
            args.append(("bias", bias, _F32, 1, "contiguous"))
        raise _refuse("gemm", tuple(args), lambda: (
            f"x {tuple(x.shape)} (row stride {x.stride(0)}), packed of {packed.numel()} "
            f"elements at {packed.data_ptr() % 64} bytes past 64-byte alignment and bias "
            f"{None if bias is None else tuple(bias.shape)} do not fit a weight "
            f"[{out_features}, {in_features}] packed by gemm_pack_weight (a fresh tensor of "
            f"{size} elements), x [M, "
            f"{in_features}], bias [{out_features}] and none for gate/up"))
    if not (_gemm_ok or gemm_available()):
        raise RuntimeError("conveyor::gemm: this CPU has no AVX2 + FMA, the GEMM is not built")
    rows = x.shape[0]
    out = torch.empty((rows, out_features // 2 if gate_up else out_features), dtype=F32)
    if rows:
        lib = lib or _lib or _native()
        rc = (lib.gemm_f32 if packed.dtype is F32 else lib.gemm_f32_w16)(
            x.data_ptr(), x.stride(0), packed.data_ptr(),
            bias.data_ptr() if bias is not None else None, out.data_ptr(), out.shape[1], rows,
            out_features, in_features, int(gate_up))
        if rc != 0:
            raise MemoryError("native GEMM: out of memory for its work buffers")
    return out


class PackedGemm:
    """A weight packed once (``gemm_pack_weight``: float32, or bfloat16 read as its exact
    float32 values) with its bias, checked once: a call ``(x)`` checks only x, then runs
    ``gemm`` (the packed operands are its own)."""

    __slots__ = ("_bias", "_fn", "_packed", "gate_up", "in_features", "out_features",
                 "width")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 gate_up: bool = False) -> None:
        gate_up = bool(gate_up)
        self._packed = gemm_pack_weight(weight, gate_up)
        if bias is not None:
            if gate_up:
                raise ValueError("conveyor::gemm: a gate/up projection takes no bias")
            if (error := _argument_error(bias, _F32, 1, "contiguous")) \
                    or bias.shape[0] != weight.shape[0]:
                raise ValueError("conveyor::gemm: bias " + (
                    error or f"has {bias.shape[0]} elements for {weight.shape[0]} outputs"))
        self._bias = bias
        self.out_features, self.in_features = weight.shape
        self.gate_up = gate_up
        self.width = self.out_features // 2 if gate_up else self.out_features
        self._fn = "gemm_f32" if weight.dtype is F32 else "gemm_f32_w16"

    @property
    def packed(self) -> torch.Tensor:
        return self._packed

    @property
    def bias(self) -> torch.Tensor | None:
        return self._bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        try:
            rows, k = x.shape
            row_stride, col_stride = x.stride()
            ok = (x.dtype is F32 and x.is_cpu and col_stride == 1 and k == self.in_features
                  and row_stride <= _INT_MAX)
        except (AttributeError, ValueError):
            ok = False
        if not ok:  # the full check says what is wrong
            return gemm(x, self._packed, self._bias, self.out_features, self.in_features,
                        self.gate_up)
        if not (_gemm_ok or gemm_available()):
            raise RuntimeError("conveyor::gemm: this CPU has no AVX2 + FMA, the GEMM is not "
                               "built")
        out = torch.empty((rows, self.width), dtype=F32)
        if rows:
            bias = self._bias
            rc = getattr(_lib or _native(), self._fn)(
                x.data_ptr(), row_stride, self._packed.data_ptr(),
                bias.data_ptr() if bias is not None else None, out.data_ptr(), self.width,
                rows, self.out_features, self.in_features, int(self.gate_up))
            if rc != 0:
                raise MemoryError("native GEMM: out of memory for its work buffers")
        return out


class GroupedGemm:
    """Several ``PackedGemm``s of one shape (a mixture of experts' gate/up or down
    projections) run in one native call (``gemm_f32_grouped``): rows ``starts[g]`` to
    ``starts[g + 1]`` of x through gemm ``g``, the threads taking runs of a group's
    output panels, its rows the same bits as that gemm's own call. The gemms are checked
    here and kept alive; a call checks x and ``starts`` (int32, one more than there are
    gemms, from 0 up to x's rows)."""

    __slots__ = ("_gemms", "_ptrs", "gate_up", "in_features", "out_features", "wbf16",
                 "width")

    def __init__(self, gemms: list[PackedGemm]) -> None:
        first = gemms[0]
        if any(g.out_features != first.out_features or g.in_features != first.in_features
               or g.gate_up != first.gate_up or g._fn != first._fn or g.bias is not None
               for g in gemms):
            raise ValueError("conveyor::gemm_grouped: the gemms differ in shape, weight "
                             "dtype or fused activation, or have a bias")
        self._gemms = list(gemms)
        self._ptrs = torch.tensor([g.packed.data_ptr() for g in gemms], dtype=I64)
        self.out_features, self.in_features = first.out_features, first.in_features
        self.gate_up, self.width = first.gate_up, first.width
        self.wbf16 = first._fn == "gemm_f32_w16"

    def __call__(self, x: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        n = len(self._gemms)
        try:
            rows, k = x.shape
            ok = (x.dtype is F32 and x.is_cpu and x.stride(1) == 1 and k == self.in_features
                  and x.stride(0) <= _INT_MAX and starts.dtype is I32 and starts.is_cpu
                  and starts.dim() == 1 and starts.is_contiguous()
                  and starts.shape[0] == n + 1)
            if ok:  # (one list, not a torch op a check: this runs twice a layer)
                bounds = starts.tolist()
                ok = bounds[0] == 0 and bounds[-1] == rows \
                    and all(a <= b for a, b in itertools.pairwise(bounds))
        except (AttributeError, ValueError, TypeError):
            ok = False
        if not ok:
            raise ValueError(
                f"conveyor::gemm_grouped: x must be float32 [rows, {self.in_features}] "
                f"with unit column stride and starts int32 [{n + 1}] rising from 0 to "
                f"rows (got x {getattr(x, 'dtype', None)} {tuple(getattr(x, 'shape', ()))}"
                f", starts {getattr(starts, 'dtype', None)} "
                f"{tuple(getattr(starts, 'shape', ()))})")
        if not (_gemm_ok or gemm_available()):
            raise RuntimeError("conveyor::gemm: this CPU has no AVX2 + FMA, the GEMM is not "
                               "built")
        out = torch.empty((rows, self.width), dtype=F32)
        if rows:
            rc = (_lib or _native()).gemm_f32_grouped(
                n, x.data_ptr(), x.stride(0), self._ptrs.data_ptr(), int(self.wbf16),
                out.data_ptr(), self.width, starts.data_ptr(), self.out_features,
                self.in_features, int(self.gate_up))
            if rc != 0:
                raise MemoryError("native GEMM: out of memory for its work buffers")
        return out


# --- draft_forward.c -------------------------------------------------------------------

class DraftForward:
    """A draft model's whole proposal in one native call (``draft_forward.c``): its
    forwards over decode rows, LM head, argmax and next inputs for k drafts of B requests.

    Built once from the model (a ``DecoderForCausalLM`` whose linears and LM head are
    ``NativeLinear`` float32 weights) and its KV caches: every tensor the C code will
    read or write is checked here (dtype, contiguity, shape) and kept alive by this
    object, so a call checks only its own index arrays. ``ValueError`` if the model does
    not fit (the caller then keeps the PyTorch path)."""

    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not gemm_available():
            raise ValueError("conveyor::draft_propose: the native GEMM is not built here")
        cfg = model.cfg
        hidden, d = cfg.hidden_size, cfg.head_dim
        layers = list(model.layers)
        if not layers or len(kv_caches) != len(layers):
            raise ValueError("conveyor::draft_propose: one KV cache per layer is needed")
        attn0 = layers[0].self_attn
        hq, hkv = attn0.num_heads, attn0.num_kv_heads
        inter = layers[0].mlp.intermediate
        if getattr(model, "tp", None) is not None and model.tp.enabled:
            raise ValueError("conveyor::draft_propose: not under tensor parallelism")
        if not getattr(model, "native_draft_ok", True):
            raise ValueError("conveyor::draft_propose: Llama's arithmetic only (this "
                             "family's norms, scales or MLP differ)")
        head = model.packed_lm_head
        embed = model.embed_tokens.weight
        vocab = embed.shape[0]
        eps = {float(n.eps) for layer in layers
               for n in (layer.input_layernorm, layer.post_attention_layernorm)}
        eps.add(float(model.norm.eps))
        self._keep: list[torch.Tensor] = []

        def tensor(t, shape, what: str) -> int:
            if not (isinstance(t, torch.Tensor) and t.dtype is F32 and t.is_cpu
                    and t.is_contiguous() and tuple(t.shape) == tuple(shape)):
                got = (f"{_dtype_name(t.dtype)} {tuple(t.shape)}"
                       if isinstance(t, torch.Tensor) else type(t).__name__)
                raise ValueError(f"conveyor::draft_propose: {what} must be a contiguous "
                                 f"float32 CPU tensor of shape {tuple(shape)}, got {got}")
            self._keep.append(t)
            return t.data_ptr()

        def packed(linear, n: int, k: int, gate_up: bool, what: str) -> tuple[int, int]:
            gemm = getattr(linear, "gemm", None)
            if not (isinstance(gemm, PackedGemm) and gemm._fn == "gemm_f32"
                    and gemm.out_features == n and gemm.in_features == k
                    and gemm.gate_up == gate_up):
                raise ValueError(f"conveyor::draft_propose: {what} must be a native "
                                 f"float32 linear of {n}x{k}" + (" (gate/up)" if gate_up
                                                                   else ""))
            self._keep.append(gemm.packed)
            bias = gemm.bias
            if bias is not None:
                self._keep.append(bias)
            return gemm.packed.data_ptr(), bias.data_ptr() if bias is not None else 0

        if len(eps) != 1:
            raise ValueError("conveyor::draft_propose: the norms' epsilons differ")
        if getattr(attn0, "qk_norm", False):
            raise ValueError("conveyor::draft_propose: per-head q/k norms are not fused")
        qkv_w = (hq + 2 * hkv) * d
        cos, sin = model.rope.cos, model.rope.sin
        ptrs = [tensor(embed, (vocab, hidden), "the embedding"),
                tensor(model.norm.weight, (hidden,), "the final norm"),
                packed(head, vocab, hidden, False, "the LM head")[0],
                tensor(cos, (cos.shape[0], d), "the RoPE cos table"),
                tensor(sin, (cos.shape[0], d), "the RoPE sin table")]
        for i, (layer, (kc, vc)) in enumerate(zip(layers, kv_caches, strict=True)):
            a, mlp = layer.self_attn, layer.mlp
            if (a.num_heads, a.num_kv_heads, a.head_dim, mlp.intermediate) != (hq, hkv, d,
                                                                                inter):
                raise ValueError("conveyor::draft_propose: layers of different shapes")
            qkv, qkv_bias = packed(a.qkv_proj, qkv_w, hidden, False, f"layer {i} QKV")
            ptrs += [tensor(layer.input_layernorm.weight, (hidden,), f"layer {i} norm"),
                     tensor(layer.post_attention_layernorm.weight, (hidden,),
                            f"layer {i} norm"),
                     qkv, qkv_bias,
                     packed(a.o_proj, hidden, hq * d, False, f"layer {i} O")[0],
                     packed(mlp.gate_up_proj, 2 * inter, hidden, True, f"layer {i} gate/up")[0],
                     packed(mlp.down_proj, hidden, inter, False, f"layer {i} down")[0],
                     tensor(kc, (kc.shape[0], hkv, d), f"layer {i} K cache"),
                     tensor(vc, (kc.shape[0], hkv, d), f"layer {i} V cache")]
        self.num_slots = kv_caches[0][0].shape[0]
        if any(kc.shape[0] != self.num_slots for kc, _ in kv_caches):
            raise ValueError("conveyor::draft_propose: the layers' caches differ in size")
        self.vocab, self.max_pos, self.eps = vocab, cos.shape[0], eps.pop()
        # The float the PyTorch path passes decode_attention, not the C code's own
        # 1 / sqrt(D): under -ffast-math that one's last bit depends on the CPU (see
        # draft_forward.c).
        self.scale = float(attn0.scale)
        self.dims = np.array([hidden, len(layers), hq, hkv, d, inter, vocab,
                              model.sliding_window or 0], dtype=np.int64)
        self.ptrs = np.array(ptrs, dtype=np.int64)

    def __call__(self, catch_ids: np.ndarray, catch_n: np.ndarray, lens0: np.ndarray,
                 ks: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """The drafts [B, max k] (row i: its first ks[i]). catch_ids int64 [sum catch_n]
        (each request's last catch_n[i] context tokens, grouped by request), catch_n
        int32 [B] (each >= 1, <= lens0[i]), lens0 int64 [B] (context lengths), ks int32
        [B] (>= 1, descending), slots int64 [B, L] (context slots; lens0 + ks - 1 <= L,
        each < the caches' slots)."""
        try:
            b = ks.shape[0]
            ok = (catch_ids.dtype == np.int64 and catch_n.dtype == np.int32
                  and lens0.dtype == np.int64 and ks.dtype == np.int32
                  and slots.dtype == np.int64 and slots.ndim == 2 and b > 0
                  and catch_n.shape == (b,) and lens0.shape == (b,)
                  and slots.shape[0] == b and catch_ids.shape == (int(catch_n.sum()),)
                  and all(a.flags.c_contiguous for a in (catch_ids, catch_n, lens0, ks,
                                                         slots)))
            ok = ok and bool(
                (ks >= 1).all() and (ks[:-1] >= ks[1:]).all() and (catch_n >= 1).all()
                and (catch_n <= lens0).all()
                and int((lens0 + ks - 1).max()) <= min(slots.shape[1], self.max_pos)
                and int(catch_ids.min()) >= 0 and int(catch_ids.max()) < self.vocab
                and int(slots.min()) >= 0 and int(slots.max()) < self.num_slots)
        except (AttributeError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError("conveyor::draft_propose: the proposal's arrays do not fit "
                             "(int64 ids and lengths, int32 catch-ups and k descending, "
                             "slots [B, L] covering every position within the caches)")
        out = np.zeros((b, int(ks[0])), dtype=np.int64)
        rc = _native().draft_propose_f32(
            self.dims.ctypes.data, self.ptrs.ctypes.data, self.eps, self.scale, b,
            catch_ids.ctypes.data, catch_n.ctypes.data, lens0.ctypes.data, ks.ctypes.data,
            slots.ctypes.data, slots.shape[1], out.ctypes.data)
        if rc == -1:
            raise MemoryError("conveyor::draft_propose: out of memory")
        if rc:
            raise RuntimeError(f"conveyor::draft_propose failed ({rc})")
        return out


# --- torch.ops.conveyor ---------------------------------------------------------------

_SCHEMAS = {
    "rms_norm": (rms_norm, "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor"),
    "add_rms_norm_": (add_rms_norm_, "add_rms_norm_(Tensor x, Tensor(a!) residual, "
                                     "Tensor weight, float eps) -> Tensor"),
    "silu_mul": (silu_mul, "silu_mul(Tensor gate_up, int intermediate) -> Tensor"),
    "rope_": (rope_, "rope_(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, "
                     "int heads, int head_dim) -> ()"),
    "decode_attention": (decode_attention, "decode_attention(Tensor q, Tensor k_cache, "
                         "Tensor v_cache, Tensor slots, Tensor lens, Tensor starts, "
                         "float scale, *, float softcap=0.) -> Tensor"),
    "prefill_attention": (prefill_attention, "prefill_attention(Tensor q, Tensor k, "
                          "Tensor v, Tensor(a!) out, float scale, *, float softcap=0.) "
                          "-> bool"),
    "prefill_attention_varlen": (prefill_attention_varlen, "prefill_attention_varlen("
                                 "Tensor q, Tensor k, Tensor v, Tensor(a!) out, "
                                 "Tensor segments, float scale, *, float softcap=0.) "
                                 "-> bool"),
    "gemm_pack_weight": (gemm_pack_weight,
                         "gemm_pack_weight(Tensor weight, bool gate_up=False) -> Tensor"),
    "gemm": (gemm, "gemm(Tensor x, Tensor packed, Tensor? bias, int out_features, "
                   "int in_features, bool gate_up=False) -> Tensor"),
}

_library = torch.library.Library("conveyor", "FRAGMENT")
for _op, (_fn, _schema) in _SCHEMAS.items():
    _library.define(_schema)
    # One checked implementation for every backend: a CUDA or meta tensor reaches the
    # checks (and their ValueError) instead of the dispatcher's "no kernel" error.
    _library.impl(_op, _fn, "CompositeExplicitAutograd")
