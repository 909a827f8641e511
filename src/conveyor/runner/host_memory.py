"""Keep freed host memory in the process instead of handing it back to the OS each step.

A CPU step allocates and frees the same tens of megabytes of activations every time
(a 2,048-token prefill's [T, 2I] gate/up output alone is 12-25 MB). glibc's malloc
serves blocks that large with mmap, or trims them off the heap top when freed, so the
next step faults every page in again: on a 2-core VM, 20-400 thousand page faults and
0.1-1 s of system time in a 1.1 s float32 prefill step, on some steps and not others
(``python -m benchmarks.steps.prefill_step`` prints both). vLLM's CPU guide preloads tcmalloc
for the same reason. Without a second allocator, glibc's own knobs do it: the largest
mmap threshold it accepts (32 MiB: blocks up to that size come from the heap) and a trim
threshold no step reaches (freed heap memory stays mapped). The cost is that the
process keeps its high-water mark of activations, which the next step reuses anyway.

``CONVEYOR_KEEP_HOST_MEMORY=0`` leaves malloc as it was.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

from conveyor import envs

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)
# mallopt takes an int: INT_MAX (2 GiB), far above what one step frees at once.
TRIM_THRESHOLD = 2**31 - 1

_applied: bool | None = None


def enabled() -> bool:
    return envs.switched_on(envs.KEEP_HOST_MEMORY)


def keep_freed_host_memory() -> bool:
    """Apply the mallopt settings once per process; True if glibc took them (False on
    another libc, or when switched off)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if not enabled():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl, macOS): nothing to tune
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
          and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
    _applied = ok
    logger.info("host memory: freed blocks kept in the process (mmap threshold 32 MiB, "
                "no trimming): %s", "applied" if ok else "refused by malloc")
    return ok
