"""Decode attention (one query token per sequence) through the C kernel of
``kernels/cpu/decode_attention.c``: it reads each context K/V row once, straight from its
slot; nothing is gathered or padded."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from conveyor.kernels.cpu import ops as native

if TYPE_CHECKING:
    from conveyor.model.attention.metadata import AttentionMetadata


class NativeDecode:
    """The C kernel (float32 and bfloat16 caches) through the checked
    ``kernels.cpu.ops.decode_attention``."""

    needs_mask = False

    def __init__(self, lib) -> None:
        self.lib = lib

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float) -> torch.Tensor:
        fp32 = q.dtype is torch.float32
        out = native.decode_attention(q.contiguous() if fp32 else q.float().contiguous(),
                                      k_cache, v_cache, meta.decode_slots, meta.decode_lens,
                                      meta.decode_starts, scale, lib=self.lib)
        return out if fp32 else out.to(q.dtype)
