"""Large, long-lived host tensors (the KV pool) on transparent huge pages.

A decode step reads every sequence's KV blocks, which the paged pool scatters over
hundreds of megabytes: with 4 KiB pages nearly every block is a TLB miss and a page
walk that the kernel's prefetches wait on. Linux backs a region with 2 MiB pages when
it is advised so (``madvise(MADV_HUGEPAGE)``) before its pages are first touched, which
works under the default ``transparent_hugepage=madvise`` as under ``always``. So the
pool is allocated untouched, advised, then zeroed. Where the advice is refused (another
OS, THP off) the tensor is the same, on small pages.

``CONVEYOR_HUGE_PAGES=0`` skips the advice.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

from conveyor import envs

MADV_HUGEPAGE = 14  # linux/mman.h
HUGE_PAGE = 2 << 20
MIN_BYTES = 4 * HUGE_PAGE  # below this a pool gains little and wastes its padding


def enabled() -> bool:
    return envs.switched_on(envs.HUGE_PAGES)


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """A contiguous zero CPU tensor of ``shape``, its pages advised huge before they are
    first touched; returns it and whether the advice was taken. The tensor is a view
    starting at a 2 MiB boundary of a slightly larger allocation."""
    numel = 1
    for n in shape:
        numel *= n
    item = dtype.itemsize
    madvise = _madvise() if enabled() and numel * item >= MIN_BYTES else None
    if madvise is None:
        return torch.zeros(shape, dtype=dtype), False
    pad = HUGE_PAGE // item
    base = torch.empty(numel + pad, dtype=dtype)  # untouched: no page is faulted in yet
    start = -base.data_ptr() % HUGE_PAGE // item  # (2 MiB is a multiple of every item)
    view = base[start:start + numel]
    advised = madvise(view.data_ptr(), numel * item // HUGE_PAGE * HUGE_PAGE,
                      MADV_HUGEPAGE) == 0
    view.zero_()
    return view.view(shape), advised
