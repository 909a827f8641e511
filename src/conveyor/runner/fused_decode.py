"""Decode-only steps of a Llama-family model as one native call (``decode_forward.c``):
every layer from the embedded rows to the final norm, on the kernels the model's modules
call one by one, so the hidden states are the ones ``model.forward`` returns.

At a few rows a step is a few hundred kernel calls, each paying for Python, ctypes and
a tensor allocation; this pays for one. ``FusedDecode.build`` returns None (the runner
keeps the PyTorch path) unless every part of the model is one the C code computes as the
modules do: a plain pre-norm Llama layer (QKV bias and Qwen3's per-head q/k norms
allowed), native float32 / bf16-weight or int8 / int4 linears (quant_gemm.c's qgemm_f32,
qgemm_a16 or qgemm_a16_i8; a linear split by row range, float or quantized, runs the
backend its range gives a step's rows: one table of linears per row count, the path
capped below a row count whose backend it cannot call), native
elementwise ops and decode attention over float32 caches, one window for every layer, no
tensor parallelism, no adapters.
``CONVEYOR_FUSED_DECODE=0`` turns it off. A step runs here only while all its rows are
decodes and there are at most ``max_rows`` of them; every other step takes the modules.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import torch

from conveyor import envs
from conveyor.kernels import cpu as kernels
from conveyor.kernels.cpu.ops import PackedGemm
from conveyor.kernels.cpu.quant import PackedA16Gemm, PackedQGemm
from conveyor.model.attention.metadata import AttentionMetadata
from conveyor.model.attention.native_decode import NativeDecode
from conveyor.model.layers.ops import NativeOps
from conveyor.model.linear.few_rows import RowSplitLinear
from conveyor.model.linear.native import NativeLinear
from conveyor.model.models.decoder import MLP, DecoderForCausalLM
from conveyor.model.quant.linear import NativeA16Linear, NativeQuantLinear, RowRangeLinear

logger = logging.getLogger(__name__)

# Rows up to which a decode step runs here: past a few rows the kernels' time dwarfs the
# per-call costs this saves (docs/results: measured side by side).
MAX_ROWS = 8
_KIND_F32, _KIND_W16, _KIND_Q, _KIND_A16 = 0, 1, 2, 3
_LIN_N = 11  # entries of a linear's row (decode_forward.c's LIN_N)


class Unsupported(ValueError):
    """What keeps the fused path off for a model (logged; the modules run instead)."""


def linear_row(mod) -> tuple[list[int], bool, object]:
    """``mod`` as ``decode_forward.c`` calls it: its row of the linears' table (LIN_N
    entries), whether it applies silu(gate) * up itself, and the object whose tensors the
    row points into (kept alive by the caller); Unsupported unless it is a native float32
    / bf16-weight or int8 / int4 linear."""
    gemm = getattr(mod, "gemm", None)
    if type(mod) is NativeLinear and type(gemm) is PackedGemm:
        kind = _KIND_F32 if gemm._fn == "gemm_f32" else _KIND_W16
        return [kind, gemm.packed.data_ptr(),
                gemm.bias.data_ptr() if gemm.bias is not None else 0,
                gemm.out_features, gemm.in_features, int(gemm.gate_up), 0, 0, 0, 0, 0], \
            bool(gemm.gate_up), gemm
    if type(mod) is NativeQuantLinear and type(gemm) is PackedQGemm and mod.perm is None:
        w, bits, nn_, s, z, group, b = gemm._args
        return [_KIND_Q, w, b or 0, nn_, gemm.in_features, int(gemm.glu), bits, s, z or 0,
                group, ctypes.cast(gemm._fn, ctypes.c_void_p).value], gemm.glu, gemm
    if type(mod) is NativeA16Linear and type(gemm) is PackedA16Gemm and mod.perm is None:
        w, nn_, s, z, group, b = gemm._args
        # (int4 qgemm_a16 or int8 qgemm_a16_i8: one signature, the kernel's pointer)
        return [_KIND_A16, w, b or 0, nn_, gemm.in_features, 0, gemm.bits, s, z or 0, group,
                ctypes.cast(gemm._fn, ctypes.c_void_p).value], False, gemm
    raise Unsupported(f"is a {type(mod).__name__} (native float, bf16 or int8 / int4 "
                      "linears only)")


class FusedDecode:
    def __init__(self, lib, dims: np.ndarray, ptrs: np.ndarray, eps: float,
                 scale: float, hidden: int, keep: list, max_rows: int) -> None:
        assert len(ptrs) == max_rows
        self._fn = lib.decode_forward_f32
        # ptrs: one table per row count (rows r: ptrs[r - 1]; row-range linears differ)
        self.dims, self.ptrs = dims, ptrs
        self.eps, self.scale, self.hidden = eps, scale, hidden
        self._keep = keep  # every tensor a pointer of the tables points into
        self.max_rows = max_rows
        self.num_steps = 0  # decode steps run here (tests, logs)

    @classmethod
    def build(cls, model, kv_caches: list, decode_kernel, max_rows: int | None = None
              ) -> FusedDecode | None:
        """The fused path for ``model`` over ``kv_caches`` (steps of up to ``max_rows``
        rows, default ``MAX_ROWS``), or None where it does not apply (the reason logged) or
        ``CONVEYOR_FUSED_DECODE`` turns it off."""
        if not envs.switched_on(envs.FUSED_DECODE):
            return None
        lib = kernels.load()
        try:
            if lib is None:
                raise Unsupported("the native kernels are not built")
            return cls._build(lib, model, kv_caches, decode_kernel, max_rows or MAX_ROWS)
        except Unsupported as e:
            logger.info("fused decode forward off: %s", e)
            return None

    @classmethod
    def _build(cls, lib, model, kv_caches, decode_kernel, max_rows) -> FusedDecode:
        if not isinstance(model, DecoderForCausalLM):
            raise Unsupported(f"{type(model).__name__} is not the shared decoder")
        if model.tp.enabled:
            raise Unsupported("tensor parallelism")
        if not model.native_draft_ok or model.local_rope is not None:
            raise Unsupported("this family's norms, scales or MLP differ from Llama's")
        if not isinstance(model.ops, NativeOps) or not isinstance(decode_kernel, NativeDecode):
            raise Unsupported("the native elementwise ops and decode attention are not in use")
        layers = list(model.layers)
        if len(set(model.layer_windows)) > 1:
            raise Unsupported("layers with different sliding windows")
        if len(kv_caches) != len(layers):
            raise Unsupported("one KV cache per layer is needed")
        cfg = model.cfg
        hidden, d = cfg.hidden_size, cfg.head_dim
        a0 = layers[0].self_attn
        hq, hkv, inter = a0.num_heads, a0.num_kv_heads, layers[0].mlp.intermediate
        keep: list = []

        def tensor(t, shape, what: str) -> int:
            if not (type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype is torch.float32
                    and t.is_cpu and t.is_contiguous() and tuple(t.shape) == tuple(shape)):
                raise Unsupported(f"{what} is not a contiguous float32 CPU tensor "
                                  f"{tuple(shape)}")
            keep.append(t)
            return t.data_ptr()

        linears: list[tuple] = []  # (index in ptrs, module, n, k, what, gate_up)

        def slot(mod, n: int, k: int, what: str, gate_up: bool = False) -> list[int]:
            """A linear's place in the tables, filled per row count below."""
            linears.append((len(ptrs), mod, n, k, what, gate_up))
            return [0] * _LIN_N

        def linear(mod, rows: int, n: int, k: int, what: str, gate_up: bool) -> list[int]:
            while type(mod) in (RowRangeLinear, RowSplitLinear):  # the rows' backend
                mod = mod.few if rows <= mod.max_rows else mod.many
            try:
                row, fused, gemm = linear_row(mod)
            except Unsupported as e:
                raise Unsupported(f"{what} {e}") from None
            keep.append(gemm)
            if row[3] != n or row[4] != k or fused != bool(getattr(mod, "applies_silu_mul",
                                                                   False)):
                raise Unsupported(f"{what}'s shape or fused activation is not the model's")
            if fused and not gate_up:
                raise Unsupported(f"{what} applies an activation")
            return row

        eps = {float(model.norm.eps)}
        ptrs = [tensor(model.rope.cos, (model.rope.cos.shape[0], d), "the RoPE cos table"),
                tensor(model.rope.sin, (model.rope.cos.shape[0], d), "the RoPE sin table"),
                tensor(model.norm.weight, (hidden,), "the final norm")]
        for i, (layer, kv) in enumerate(zip(layers, kv_caches, strict=True)):
            at, mlp = layer.self_attn, layer.mlp
            if layer.layout != "pre" or at.qk_norm_full or at.softcap \
                    or type(mlp) is not MLP or not mlp.fuses_silu:
                raise Unsupported(f"layer {i} is not a plain Llama layer")
            if (at.num_heads, at.num_kv_heads, at.head_dim, mlp.intermediate) != (
                    hq, hkv, d, inter) or at.scale != a0.scale:
                raise Unsupported("layers of different shapes")
            kc, vc = kv
            eps |= {float(layer.input_layernorm.eps),
                    float(layer.post_attention_layernorm.eps)}
            ptrs += [tensor(layer.input_layernorm.weight, (hidden,), f"layer {i}'s norm"),
                     tensor(layer.post_attention_layernorm.weight, (hidden,),
                            f"layer {i}'s norm"),
                     tensor(kc, (kv_caches[0][0].shape[0], hkv, d), f"layer {i}'s K cache"),
                     tensor(vc, (kv_caches[0][0].shape[0], hkv, d), f"layer {i}'s V cache")]
            if at.qk_norm:  # Qwen3: each head's q and k normed before the rotation
                eps |= {float(at.q_norm.eps), float(at.k_norm.eps)}
                ptrs += [tensor(at.q_norm.weight, (d,), f"layer {i}'s q norm"),
                         tensor(at.k_norm.weight, (d,), f"layer {i}'s k norm")]
            else:
                ptrs += [0, 0]
            ptrs += slot(at.qkv_proj, (hq + 2 * hkv) * d, hidden, f"layer {i}'s QKV")
            ptrs += slot(at.o_proj, hidden, hq * d, f"layer {i}'s O")
            ptrs += slot(mlp.gate_up_proj, 2 * inter, hidden, f"layer {i}'s gate/up",
                         gate_up=True)
            ptrs += slot(mlp.down_proj, hidden, inter, f"layer {i}'s down")
        if len(eps) != 1:
            raise Unsupported("the norms' epsilons differ")
        tables: list[np.ndarray] = []
        for rows in range(1, max_rows + 1):
            table = list(ptrs)
            try:
                for at_, mod, n, k, what, gate_up in linears:
                    table[at_:at_ + _LIN_N] = linear(mod, rows, n, k, what, gate_up)
            except Unsupported:
                if rows == 1:
                    raise
                break  # (a larger calls' backend it cannot call: the path stops below)
            tables.append(np.array(table, dtype=np.int64))
        dims = np.array([hidden, len(layers), hq, hkv, d, inter], dtype=np.int64)
        # The scale the modules pass decode_attention (not recomputed in C: see
        # draft_forward.c on 1 / sqrt(D) under -ffast-math).
        return cls(lib, dims, tables, eps.pop(), float(a0.scale), hidden, keep, len(tables))

    def applies(self, meta: AttentionMetadata, rows: int) -> bool:
        """A step of decode rows only, no more than ``max_rows``."""
        return (0 < rows <= self.max_rows and meta.num_decodes == rows and not meta.prefills
                and not meta.by_window)

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """The final normed hidden states [R, hidden] of the embedded rows ``hidden``
        (float32 [R, hidden], overwritten) at ``positions``, writing each row's K/V at
        ``meta.slot_mapping``."""
        r = hidden.shape[0]
        slots, lens, starts = meta.decode_slots, meta.decode_lens, meta.decode_starts
        if not (hidden.dtype is torch.float32 and hidden.is_contiguous()
                and hidden.shape == (r, self.hidden) and positions.dtype is torch.int64
                and positions.is_contiguous() and meta.slot_mapping.dtype is torch.int64
                and meta.slot_mapping.is_contiguous() and slots.dtype is torch.int64
                and slots.is_contiguous() and slots.shape[0] == r
                and lens.dtype is torch.int32 and starts.dtype is torch.int32
                and lens.is_contiguous() and starts.is_contiguous()):
            raise ValueError("fused decode forward: the step's tensors are not the "
                             "contiguous float32 / int64 / int32 rows it takes")
        out = torch.empty((r, self.hidden), dtype=torch.float32)
        rc = self._fn(self.dims.ctypes.data, self.ptrs[r - 1].ctypes.data, self.eps,
                      self.scale, r, hidden.data_ptr(), positions.data_ptr(),
                      meta.slot_mapping.data_ptr(), slots.data_ptr(), lens.data_ptr(),
                      starts.data_ptr(), slots.shape[1], out.data_ptr())
        if rc == -1:
            raise MemoryError("fused decode forward: out of memory")
        if rc:
            raise RuntimeError(f"fused decode forward failed ({rc})")
        self.num_steps += 1
        return out
