"""The attention backends by name. Each backend's module is imported on first lookup; a
backend module never imports this one.

Built in, in priority order: ``native`` (the C kernels on CPU, float32 or bfloat16),
``sdpa`` (anywhere), then ``triton`` (one unified Triton kernel; CUDA, or the CPU under
TRITON_INTERPRET=1) and ``flashinfer`` (CUDA, half precision), chosen by name. Adding
one is a module with its ``AttentionBackend`` subclass and one ``attention_backends.add``
line here (or ``attention_backends.register`` on a class from outside)::

    class CudaOnlyBackend(AttentionBackend):
        name = "cuda-only"
        @classmethod
        def supports(cls, device, dtype, num_heads, num_kv_heads, head_dim=None):
            return None if device.type == "cuda" else "needs a CUDA device"
        def decode_kernel(self):
            return CudaOnlyDecode(self.num_heads, self.num_kv_heads)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from conveyor.model.attention.backend import AttentionBackend
from conveyor.model.backend_registry import Registry

attention_backends: Registry[type[AttentionBackend]] = Registry("attention")
attention_backends.add("native", 100, "conveyor.model.attention.native:NativeAttentionBackend")
attention_backends.add("sdpa", 0, "conveyor.model.attention.sdpa:SdpaAttentionBackend")
# Last: chosen by name until a GPU run has held it to the reference (no device was lent
# when it was written; its CPU tests run it under Triton's interpreter).
attention_backends.add("triton", -10,
                       "conveyor.model.attention.triton_backend:TritonAttentionBackend")
attention_backends.add("flashinfer", -20,
                       "conveyor.model.attention.flashinfer_backend:FlashInferAttentionBackend")


def attention_backend_names_for(device: torch.device | str, dtype: torch.dtype,
                                num_heads: int, num_kv_heads: int,
                                head_dim: int | None = None) -> list[str]:
    """The registered attention backends that support this model, by priority."""
    return attention_backends.applicable(torch.device(device), dtype, num_heads,
                                         num_kv_heads, head_dim=head_dim)


def select_attention_backend(name: str, device: torch.device | str, dtype: torch.dtype,
                             num_heads: int, num_kv_heads: int,
                             head_dim: int | None = None) -> AttentionBackend:
    """An instance of attention backend ``name`` (or the ``auto`` choice) for this model."""
    device = torch.device(device)
    cls = attention_backends.select(name, device, dtype, num_heads, num_kv_heads,
                                    head_dim=head_dim)
    return cls(device, dtype, num_heads, num_kv_heads, head_dim)


def pick_decode_kernel(backend: str, device: torch.device, dtype: torch.dtype,
                       num_heads: int, num_kv_heads: int) -> Callable:
    """The decode callable of attention backend ``backend`` (a registered name or
    ``auto``: the first registered that applies)."""
    return select_attention_backend(backend, device, dtype, num_heads,
                                    num_kv_heads).decode_kernel()
