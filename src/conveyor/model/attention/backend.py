"""What an attention backend provides: a decode kernel over the paged cache, and
optionally a fresh-prompt prefill kernel and the fused elementwise ops that go with it
(the signatures are ``metadata.AttentionMetadata``'s)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from conveyor.model.layers.ops import TorchOps


class AttentionBackend:
    """One attention implementation; ``registry.py`` names it and gives its priority."""

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 0

    def __init__(self, device: torch.device, dtype: torch.dtype, num_heads: int,
                 num_kv_heads: int, head_dim: int | None = None) -> None:
        self.device, self.dtype = device, dtype
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, num_heads: int,
                 num_kv_heads: int, head_dim: int | None = None) -> str | None:
        """None if the backend can run this configuration, else why not."""
        return None

    def decode_kernel(self) -> Callable:
        """``(q, k_cache, v_cache, meta, scale) -> out``; its ``needs_mask`` attribute says
        whether ``meta.decode_mask`` must be built."""
        raise NotImplementedError

    def prefill_kernel(self) -> Callable | None:
        """``(q, k, v, out, scale) -> bool`` for a fresh prompt, or None (SDPA)."""
        return None

    def layer_ops(self) -> TorchOps | None:
        """The decoder's elementwise ops to install, or None to keep ``TorchOps``."""
        return None
