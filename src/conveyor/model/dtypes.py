"""Which dtype the arithmetic runs in, given the weights' dtype and the device.

bfloat16 weights on a CPU without bf16 instructions (x86 without AVX-512 BF16 or AMX,
Arm without the BF16 extension) make every matrix multiplication convert and emulate,
far slower than float32 there. ``auto`` then computes in float32 on the weights'
bf16-rounded values: the model's numbers, at float32's speed, for twice the weights'
memory (and a float32 KV cache).
"""

from __future__ import annotations

import functools
import platform
from typing import TYPE_CHECKING

from conveyor.kernels.cpu.cpuinfo import cpu_flags

if TYPE_CHECKING:
    import torch

COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True if this CPU multiplies bf16 natively (x86 AVX-512 BF16 or AMX-BF16; Arm BF16)."""
    flags = cpu_flags()
    if flags is None:
        return platform.machine() == "arm64"  # Apple silicon (M2 on) has BF16; others: no /proc
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def resolve_compute_dtype(requested: str, dtype: str, device: torch.device) -> str:
    """``requested`` unless ``auto``: then ``dtype``, except float32 for bfloat16 on a CPU
    that lacks bf16 instructions."""
    if requested not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype must be one of {COMPUTE_DTYPES}, got {requested!r}")
    if requested != "auto":
        return requested
    if dtype == "bfloat16" and device.type == "cpu" and not cpu_has_native_bf16():
        return "float32"
    return dtype
