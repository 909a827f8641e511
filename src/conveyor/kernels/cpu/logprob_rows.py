"""Prompt logprobs' row reductions (``logprob_rows.c``): its own small library, built and
cached as the main one is (same compiler, flags and cache root), so that a change to it
does not rebuild or re-key the other kernels.

``reduce_rows`` checks every argument before handing pointers to C. ``load()`` is None
where the kernels are off (``CONVEYOR_NATIVE_KERNELS=0``) or cannot be built: callers
then take the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import subprocess

import torch

from conveyor.kernels import cpu as kernels
from conveyor.kernels.cpu import small_library

logger = logging.getLogger(__name__)

_DIR = os.path.dirname(__file__)
_SOURCE = os.path.join(_DIR, "logprob_rows.c")
_HEADERS = [os.path.join(_DIR, name) for name in ("simd_math.h", "simd_exp.h", "bf16.h")]
_PTR, _I32, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


@functools.cache
def load_variant(isa: str) -> ctypes.CDLL | None:
    """The library built for ``isa`` (``kernels.ISA_FLAGS``); None if it does not build."""
    if platform.system() != "Linux":
        return None
    flags = [*kernels._FLAGS, *kernels._isa_flags(isa)]
    try:
        lib = small_library.build("logprob-rows", _SOURCE, flags, tuple(_HEADERS))
    except (OSError, subprocess.CalledProcessError) as e:
        logger.warning("prompt logprobs' row kernel disabled: %s",
                       (getattr(e, "stderr", "") or str(e)).strip()[:500])
        return None
    for name in ("logprob_rows_f32", "logprob_rows_bf16"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = [_PTR, _I32, _I32, _I64, _PTR, _I32, _PTR, _PTR, _PTR,
                                       _PTR]
    lib.logprob_rows_simd.restype = ctypes.c_int
    lib.logprob_rows_simd.argtypes = []
    lib.logprob_rows_max_k.restype = ctypes.c_int
    lib.logprob_rows_max_k.argtypes = []
    return lib


def load() -> ctypes.CDLL | None:
    """This CPU's build (capped by ``CONVEYOR_KERNEL_ISA``); None where kernels are off
    or it does not build."""
    if not kernels.native_kernels_enabled():
        return None
    return load_variant(kernels.kernel_isa())


def max_k(lib: ctypes.CDLL) -> int:
    """The most top alternatives the kernel keeps (beyond it: the torch path)."""
    return int(lib.logprob_rows_max_k())


def reduce_rows(logits: torch.Tensor, targets: torch.Tensor, k: int, lib: ctypes.CDLL
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token logprob [R], rank [R] int32, top ids [R, k] int64, top logprobs [R, k]
    float32) of float32 or bfloat16 CPU ``logits`` [R, V] (rows unit-stride, finite) for
    int64 ``targets`` [R]; bfloat16 rows give what their float32 upcast gives."""
    if logits.dtype not in (torch.float32, torch.bfloat16) or logits.dim() != 2 \
            or logits.stride(1) != 1 or logits.device.type != "cpu":
        raise ValueError("conveyor::logprob_rows: logits must be float32 or bfloat16 [R, V] "
                         f"on CPU with unit column stride, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    rows, vocab = logits.shape
    if targets.dtype != torch.int64 or tuple(targets.shape) != (rows,) \
            or not targets.is_contiguous() or targets.device.type != "cpu":
        raise ValueError(f"conveyor::logprob_rows: targets must be contiguous int64 [{rows}]"
                         f" on CPU, got {targets.dtype} {tuple(targets.shape)}")
    if not 0 <= k <= min(vocab, max_k(lib)):
        raise ValueError(f"conveyor::logprob_rows: k must be in [0, {min(vocab, max_k(lib))}]"
                         f", got {k}")
    token_lp = torch.empty(rows, dtype=torch.float32)
    rank = torch.empty(rows, dtype=torch.int32)
    top_ids = torch.empty(rows, k, dtype=torch.int64)
    top_lp = torch.empty(rows, k, dtype=torch.float32)
    if rows:
        fn = lib.logprob_rows_f32 if logits.dtype == torch.float32 else lib.logprob_rows_bf16
        rc = fn(logits.data_ptr(), rows, vocab, logits.stride(0), targets.data_ptr(), k,
                token_lp.data_ptr(), rank.data_ptr(), top_ids.data_ptr(), top_lp.data_ptr())
        if rc != 0:
            raise ValueError("conveyor::logprob_rows: the kernel refused its arguments "
                             "(a target id outside the vocabulary?)")
    return token_lp, rank, top_ids, top_lp
