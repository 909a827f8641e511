"""The ``native`` attention backend: the C kernels of ``conveyor.kernels.cpu`` on CPU."""

from __future__ import annotations

import torch

from conveyor.kernels import cpu as kernels
from conveyor.model.attention.backend import AttentionBackend
from conveyor.model.attention.native_decode import NativeDecode
from conveyor.model.attention.native_prefill import NativePrefill
from conveyor.model.layers.ops import NativeOps


class NativeAttentionBackend(AttentionBackend):
    """Decode over float32 or bfloat16 caches, the fresh-prompt prefill and the fused
    elementwise ops, all in C (CPU)."""

    name = "native"

    @classmethod
    def supports(cls, device, dtype, num_heads, num_kv_heads, head_dim=None):
        if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return "needs a CPU device and a float32 or bfloat16 model"
        if kernels.load() is None:
            return "the native kernels are unavailable " + kernels.why_unavailable()
        return None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lib = kernels.load()

    def decode_kernel(self) -> NativeDecode:
        return NativeDecode(self.lib)

    def prefill_kernel(self) -> NativePrefill | None:
        return (NativePrefill(self.lib) if self.dtype in (torch.float32, torch.bfloat16)
                else None)

    def layer_ops(self) -> NativeOps | None:
        # bfloat16 too: the kernels compute in fp32 and round where TorchOps does.
        return (NativeOps(self.lib) if self.dtype in (torch.float32, torch.bfloat16)
                else None)
