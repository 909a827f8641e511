"""The decoder layer's elementwise steps, in PyTorch or as fused native kernels.

``TorchOps`` is the reference, for any device and dtype. ``NativeOps`` runs the same
arithmetic as single-pass C kernels (float32 on CPU), where eager PyTorch would spend
more time dispatching small ops than computing at decode batch sizes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from conveyor.model.llama import RMSNorm, RotaryEmbedding


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

    def silu_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        gate, up = gate_up.split(intermediate, dim=-1)
        return F.silu(gate) * up


class NativeOps(TorchOps):
    """Fused C kernels (``kernels/elementwise.c``) for float32 tensors on CPU."""

    def __init__(self, lib) -> None:
        self.lib = lib

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        out = torch.empty_like(x)
        rows, dim = x.shape
        self.lib.rms_norm_f32(x.data_ptr(), norm.weight.data_ptr(), out.data_ptr(), rows, dim,
                              norm.eps)
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty_like(x)
        rows, dim = x.shape
        self.lib.add_rms_norm_f32(x.data_ptr(), residual.data_ptr(), norm.weight.data_ptr(),
                                  out.data_ptr(), rows, dim, norm.eps)  # residual += x
        return out, residual

    def rope_(self, rope: RotaryEmbedding, positions: torch.Tensor, qkv: torch.Tensor,
              num_heads: int, num_kv_heads: int, head_dim: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t, row = qkv.shape
        self.lib.rope_f32(qkv.data_ptr(), positions.data_ptr(), rope.cos.data_ptr(),
                          rope.sin.data_ptr(), t, num_heads + num_kv_heads, row, head_dim)
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return (q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim),
                v.view(t, num_kv_heads, head_dim))

    def silu_mul(self, gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
        rows = gate_up.shape[0]
        out = torch.empty((rows, intermediate), dtype=gate_up.dtype)
        self.lib.silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), rows, intermediate)
        return out
