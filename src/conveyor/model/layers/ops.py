"""The decoder layer's elementwise steps, in PyTorch or as fused native kernels.

``TorchOps`` is the reference, for any device and dtype. ``NativeOps`` runs the same
arithmetic as single-pass C kernels (float32 or bfloat16 on CPU), where eager PyTorch would spend
more time dispatching small ops than computing at decode batch sizes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from conveyor.kernels.cpu import ops as native

if TYPE_CHECKING:
    from conveyor.model.layers.norm import RMSNorm
    from conveyor.model.layers.rotary import RotaryEmbedding


class TorchOps:
    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return norm(x)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the pre-norm residual stream."""
        residual = residual + x
        return norm(residual), residual

    def rope_(self, rope: RotaryEmbedding, positions: torch.Tensor, qkv: torch.Tensor,
              num_heads: int, num_kv_heads: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split a packed QKV row batch into q, k (rotated) and v: [T, H, D] each."""
        t = qkv.shape[0]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(t, num_heads, head_dim)
        k = k.view(t, num_kv_heads, head_dim)
        q, k = rope(positions, q, k)
        return q, k, v.view(t, num_kv_heads, head_dim)

    def head_norms_rope_(self, rope: RotaryEmbedding, positions: torch.Tensor,
                         qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm,
                         num_heads: int, num_kv_heads: int, head_dim: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As ``rope_``, each head of q and k RMS-normed first (Qwen3)."""
        t = qkv.shape[0]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q_norm(q.view(t, num_heads, head_dim))
        k = k_norm(k.view(t, num_kv_heads, head_dim))
        q, k = rope(positions, q, k)
        return q, k, v.view(t, num_kv_heads, head_dim)

    def silu_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        gate, up = gate_up.split(intermediate, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        """Gemma's GeGLU: gelu-tanh(gate) * up."""
        gate, up = gate_up.split(intermediate, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        """``cap * tanh(x / cap)`` (Gemma 2's final logits), as transformers computes it;
        may write x in place."""
        return torch.tanh(x / cap) * cap


class NativeOps(TorchOps):
    """Fused C kernels (``kernels/cpu/elementwise.c``) for float32 or bfloat16 tensors on CPU
    (bf16: fp32 inside, rounded where TorchOps rounds), called
    through the checked entry points of ``kernels/cpu/ops.py``: a tensor they cannot take
    raises a ValueError instead of reaching the C code."""

    def __init__(self, lib) -> None:
        self.lib = lib

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        return native.rms_norm(x, norm.weight, norm.eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        return native.add_rms_norm_(x, residual, norm.weight, norm.eps), residual

    def rope_(self, rope: RotaryEmbedding, positions: torch.Tensor, qkv: torch.Tensor,
              num_heads: int, num_kv_heads: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        native.rope_(qkv, positions, rope.cos, rope.sin, num_heads + num_kv_heads, head_dim)
        # The views TorchOps.rope_ returns, in one view and one split.
        return qkv.view(qkv.shape[0], num_heads + 2 * num_kv_heads, head_dim).split_with_sizes(
            (num_heads, num_kv_heads, num_kv_heads), 1)

    def head_norms_rope_(self, rope: RotaryEmbedding, positions: torch.Tensor,
                         qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm,
                         num_heads: int, num_kv_heads: int, head_dim: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The heads normed in place by the RMS norm kernel (its numbers, which the fused
        decode forward repeats: runner/fused_decode.py), then the native rotation."""
        if not (qkv.is_contiguous() and q_norm.weight.dtype is qkv.dtype
                and k_norm.weight.dtype is qkv.dtype):
            return super().head_norms_rope_(rope, positions, qkv, q_norm, k_norm, num_heads,
                                            num_kv_heads, head_dim)
        t, start = qkv.shape[0], 0
        for norm, heads in ((q_norm, num_heads), (k_norm, num_kv_heads)):
            part = qkv[:, start:start + heads * head_dim]
            # (one head a rank under tensor parallelism: the reshape is then a strided
            # view, which the kernel does not take)
            rows = part.reshape(t * heads, head_dim).contiguous()
            part.copy_(native.rms_norm(rows, norm.weight, norm.eps).view(t, heads * head_dim))
            start += heads * head_dim
        return self.rope_(rope, positions, qkv, num_heads, num_kv_heads, head_dim)

    def silu_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        return native.silu_mul(gate_up, intermediate)

    # float32 in one native pass each; bf16 (rounded where torch rounds) stays in torch.
    def gelu_tanh_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        if gate_up.dtype is not torch.float32 or not gate_up.is_contiguous():
            return super().gelu_tanh_mul(gate_up, intermediate)
        return native.gelu_tanh_mul(gate_up, intermediate)

    def softcap(self, x: torch.Tensor, cap: float) -> torch.Tensor:
        if x.dtype is not torch.float32 or not x.is_contiguous():
            return super().softcap(x, cap)
        return native.softcap_(x, cap)
