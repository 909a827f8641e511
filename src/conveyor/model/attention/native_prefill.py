"""Causal attention of fresh prompts through ``kernels/cpu/prefill_attention.c``."""

from __future__ import annotations

import torch

from conveyor.kernels.cpu import ops as native


class NativePrefill:
    """Causal attention of a fresh prompt through the C kernel.

    Reads q, k, v where the QKV projection left them (rows of a strided view) and writes
    ``out`` in place; declines (returns False) what it was not compiled for, and the
    segment then goes to SDPA. Anything else wrong with the tensors raises (the checked
    ``kernels.cpu.ops.prefill_attention``). ``softcap``: Gemma 2's logit cap, inside the
    kernel.
    """

    takes_softcap = True

    def __init__(self, lib) -> None:
        self.lib = lib

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                 scale: float, softcap: float | None = None) -> bool:
        # float32, or bfloat16 read and written as such (float32 sums inside; the AVX-512
        # BF16 body also rounds the softmax numerators for P @ V, as SDPA does in bf16).
        if not self._takes(q, k, v, out):
            return False
        return native.prefill_attention(q, k, v, out, scale, self.lib, softcap=softcap or 0.0)

    def varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               segments: torch.Tensor, scale: float, softcap: float | None = None) -> bool:
        """The fresh prompts of a flat batch in one call (``AttentionMetadata.
        fresh_segments``): one Python call a layer instead of one a prompt."""
        if not segments.shape[1] or not self._takes(q, k, v, out):
            return False
        return native.prefill_attention_varlen(q, k, v, out, segments, scale, self.lib,
                                               softcap=softcap or 0.0)

    @staticmethod
    def _takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> bool:
        d, dt = q.shape[2], q.dtype
        return (dt in (torch.float32, torch.bfloat16) and k.dtype == dt and v.dtype == dt
                and out.dtype == dt
                and all(x.stride(2) == 1 and x.stride(1) == d for x in (q, k, v, out))
                and k.stride(0) == v.stride(0))
