"""A packed token bitmask applied to float32 logits (``token_bitmask.c``): its own small
library, built and cached like the main one (same compiler and cache root; no
-ffast-math, as it writes -inf), so a change to it does not rebuild the others.

``apply_token_bitmask`` checks every argument before handing pointers to C, and runs a
numpy fallback where the kernels are off (``CONVEYOR_NATIVE_KERNELS=0``) or do not build.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import subprocess

import numpy as np
import torch

from conveyor.kernels import cpu as kernels
from conveyor.kernels.cpu import small_library

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "token_bitmask.c")
_FLAGS = ["-O3", "-march=native", "-fPIC"]
_PTR, _I32, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


@functools.cache
def load() -> ctypes.CDLL | None:
    """The library, built on first use; None if kernels are off or it does not build."""
    if not kernels.native_kernels_enabled() or platform.system() != "Linux":
        return None
    flags = [*_FLAGS, *kernels._isa_flags(kernels.kernel_isa())]
    try:
        lib = small_library.build("bitmask", _SOURCE, flags)
    except (OSError, subprocess.CalledProcessError) as e:
        logger.warning("token bitmask kernel disabled: %s",
                       (getattr(e, "stderr", "") or str(e)).strip()[:500])
        return None
    lib.apply_token_bitmask_f32.restype = _I32
    lib.apply_token_bitmask_f32.argtypes = [_PTR, _I64, _I32, _PTR, _I32, _PTR, _I32]
    return lib


def apply_token_bitmask(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor,
                        native: bool = True) -> torch.Tensor:
    """Set to -inf, in place, every token of ``logits[rows[r]]`` that bit-packed ``mask[r]``
    does not allow (bit i of int32 word j: token 32 j + i). ``logits``: float32 [n, vocab]
    on the CPU, rows contiguous; ``mask``: int32 [len(rows), words], contiguous;
    ``rows``: int64, distinct, in range. Rows not named are left as they are."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.device.type != "cpu" \
            or logits.stride(1) != 1:
        raise ValueError("logits must be a float32 [n, vocab] CPU tensor, rows contiguous")
    if mask.dtype != torch.int32 or mask.dim() != 2 or not mask.is_contiguous():
        raise ValueError("mask must be a contiguous int32 [rows, words] tensor")
    if rows.dtype != torch.int64 or rows.dim() != 1 or not rows.is_contiguous() \
            or rows.numel() != mask.shape[0]:
        raise ValueError("rows must be a contiguous int64 vector, one per mask row")
    n, vocab = logits.shape
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
        raise ValueError(f"rows must lie in [0, {n})")
    lib = load() if native else None
    if lib is None:
        return _apply_numpy(logits, mask, rows)
    lib.apply_token_bitmask_f32(logits.data_ptr(), logits.stride(0), vocab, mask.data_ptr(),
                                mask.shape[1], rows.data_ptr(), rows.numel())
    return logits


def _apply_numpy(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor
                 ) -> torch.Tensor:
    # Unpacked least significant bit first: little-endian words give tokens in order.
    vocab = logits.shape[1]
    banned = np.unpackbits((~mask.numpy()).view(np.uint8), axis=1, bitorder="little")
    if banned.shape[1] < vocab:  # tokens past the mask's words are banned
        banned = np.pad(banned, ((0, 0), (0, vocab - banned.shape[1])), constant_values=1)
    banned = torch.from_numpy(np.ascontiguousarray(banned[:, :vocab])).view(torch.bool)
    sub = logits.index_select(0, rows).masked_fill_(banned, float("-inf"))
    return logits.index_copy_(0, rows, sub)
