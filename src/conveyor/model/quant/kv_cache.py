"""A quantized KV cache (``--kv-cache-dtype fp8_e4m3 | fp8_e5m2 | int8``): one byte per
element, and one float32 scale per written token and KV head (its absmax over the head's
``head_dim`` values over the format's largest value), so that every head of every token
uses the format's whole range and a token's stored bytes depend on that token alone
(not on the batch it was written in).

``QuantizedKV`` stands in for a layer's K or V pool where attention reads it: written
with ``index_copy_`` (quantized), read by indexing (dequantised to the compute dtype) or
by the native decode kernel (its codes and scales, dequantised in registers:
``kernels/cpu/decode_attention.c``). The gathering paths read it by indexing: ``sdpa``'s
decode, and on both backends a prefill chunk's cached context (chunked prefill, prefix
hits) and soft-capped layers. A quantized cache runs on ``native`` or ``sdpa``
(``attention_backend_for``); the other backends' kernels read plain pools. Fresh prompts
attend to their own K/V unquantized, as vLLM's do.
"""

from __future__ import annotations

import torch

from conveyor.kernels import cpu as kernels
from conveyor.kernels.cpu import ops as native_ops

# The pool's element type and its largest finite value.
FORMATS = {"int8": (torch.int8, 127.0),
           "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
           "fp8_e5m2": (torch.float8_e5m2, 57344.0)}
SCALE_BYTES = 4  # per token and KV head


def bytes_per_element(kv_cache_dtype: str, compute_itemsize: int, head_dim: int) -> float:
    """What one K or V element costs in the pool, its share of the scale included."""
    if kv_cache_dtype == "auto":
        return compute_itemsize
    return 1 + SCALE_BYTES / head_dim


def attention_backend_for(kv_cache_dtype: str, attention_backend: str,
                          device: torch.device, dtype: torch.dtype) -> str:
    """The attention backend a quantized cache runs on: ``native`` or ``sdpa`` as asked;
    for ``auto`` native where it applies (the start-up measurement times float pools, not
    this one), else sdpa. ValueError for another backend."""
    if kv_cache_dtype == "auto" or attention_backend in ("native", "sdpa"):
        return attention_backend
    if attention_backend != "auto":
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype} runs on the native and sdpa "
                         f"attention backends (the {attention_backend} kernels read plain "
                         "pools)")
    from conveyor.model.attention.registry import attention_backend_names_for

    native = "native" in attention_backend_names_for(device, dtype, 1, 1)
    return "native" if native else "sdpa"


class QuantizedKV:
    """A ``[num_slots, num_kv_heads, head_dim]`` pool of one-byte elements with a
    ``[num_slots, num_kv_heads]`` float32 scale. ``native``: writes through the C kernel
    (``kernels/cpu/kv_store.c``: the same bytes in one call) where the input allows."""

    def __init__(self, num_slots: int, num_heads: int, head_dim: int, kv_cache_dtype: str,
                 dtype: torch.dtype, device: torch.device, native: bool = False) -> None:
        storage, self.qmax = FORMATS[kv_cache_dtype]
        self.kind = kv_cache_dtype
        self.data = torch.zeros(num_slots, num_heads, head_dim, dtype=storage, device=device)
        self.scale = torch.ones(num_slots, num_heads, dtype=torch.float32, device=device)
        self.dtype = dtype  # what reads return (the compute dtype)
        self.device = torch.device(device)
        self.native = native and self.device.type == "cpu"

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def element_size(self) -> int:
        return self.data.element_size()

    def numel(self) -> int:
        return self.data.numel()

    def index_copy_(self, dim: int, index: torch.Tensor, x: torch.Tensor) -> QuantizedKV:
        assert dim == 0
        if (self.native and x.dtype in (torch.float32, torch.bfloat16)
                and x.stride(2) == 1 and x.stride(1) == x.shape[2]):
            native_ops.kv_store_q8(x, index, self.data, self.scale)
            return self
        x = x.to(torch.float32)
        scale = (x.abs().amax(dim=-1) / self.qmax).clamp_min(1e-12)  # [T, H]
        y = x / scale.unsqueeze(-1)
        q = torch.round(y).clamp_(-127, 127).to(torch.int8) if self.kind == "int8" \
            else y.to(self.data.dtype)
        # (as bytes: CPU index ops do not take float8 tensors)
        self.data.view(torch.uint8).index_copy_(0, index, q.view(torch.uint8))
        self.scale.index_copy_(0, index, scale)
        return self

    def __getitem__(self, index) -> torch.Tensor:
        data = self.data.view(torch.uint8)[index].view(self.data.dtype)
        return (data.to(torch.float32) * self.scale[index].unsqueeze(-1)).to(self.dtype)


def quantized_kv_caches(num_layers: int, num_slots: int, num_heads: int, head_dim: int,
                        kv_cache_dtype: str, dtype: torch.dtype, device: torch.device
                        ) -> list[tuple[QuantizedKV, QuantizedKV]]:
    """Every layer's K and V pools, written by the native kernel where it is built."""
    native = torch.device(device).type == "cpu" and kernels.load() is not None
    return [tuple(QuantizedKV(num_slots, num_heads, head_dim, kv_cache_dtype, dtype, device,
                              native) for _ in range(2))
            for _ in range(num_layers)]
