"""Decode attention (one query token per sequence) through the C kernel of
``kernels/cpu/decode_attention.c``: it reads each context K/V row once, straight from its
slot; nothing is gathered or padded."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from conveyor.kernels.cpu import ops as native
from conveyor.model.quant.kv_cache import QuantizedKV

if TYPE_CHECKING:
    from conveyor.model.attention.metadata import AttentionMetadata


class NativeDecode:
    """The C kernel through the checked ``kernels.cpu.ops``: float32 and bfloat16 caches
    (``decode_attention``), and the one-byte caches of ``--kv-cache-dtype``
    (``decode_attention_q8``)."""

    needs_mask = False
    takes_softcap = True  # Gemma 2's logit cap, inside the kernel (softcap.h)

    def __init__(self, lib) -> None:
        self.lib = lib

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float,
                 softcap: float | None = None) -> torch.Tensor:
        fp32 = q.dtype is torch.float32
        qf = q.contiguous() if fp32 else q.float().contiguous()
        if isinstance(k_cache, QuantizedKV):  # one-byte codes, dequantised in the kernel
            out = native.decode_attention_q8(qf, k_cache.data, k_cache.scale, v_cache.data,
                                             v_cache.scale, meta.decode_slots,
                                             meta.decode_lens, meta.decode_starts, scale,
                                             lib=self.lib, softcap=softcap or 0.0)
        else:
            out = native.decode_attention(qf, k_cache, v_cache, meta.decode_slots,
                                          meta.decode_lens, meta.decode_starts, scale,
                                          lib=self.lib, softcap=softcap or 0.0)
        return out if fp32 else out.to(q.dtype)
