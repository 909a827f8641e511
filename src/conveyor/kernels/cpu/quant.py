"""The quantized-weight GEMM (``quant_gemm.c``): its own small library, built and cached
as the main one is (same compiler, flags and cache root), so that a change to it does not
rebuild or re-key the others' kernels.

``PackedQGemm`` checks the weight once and x on every call before handing pointers to
C. None from ``load()`` where the kernels are off (``CONVEYOR_NATIVE_KERNELS=0``) or
cannot be built.
``load(isa)`` builds another instruction-set cap (tests run the AVX2 and portable bodies
side by side); ``build(source, isa)`` another version of the source (a benchmark's
before and after in one process).
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

_SOURCE = os.path.join(os.path.dirname(__file__), "quant_gemm.c")
# the headers it includes (part of the build's key)
_HEADERS = tuple(os.path.join(os.path.dirname(__file__), h)
                 for h in ("simd_math.h", "simd_exp.h"))
_PTR, _I32 = ctypes.c_void_p, ctypes.c_int
_INT_MAX = 2**31 - 1


@functools.cache
def build_id() -> str:
    """This kernel's source and flags as a key: measured backend choices that can land on
    it are keyed by it (the main library's build key does not cover this source)."""
    return small_library.cache_key(
        _SOURCE, [*kernels._FLAGS, *kernels._isa_flags(kernels.kernel_isa())], _HEADERS)


@functools.cache
def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The library (for ISA cap ``isa``, default ``CONVEYOR_KERNEL_ISA``'s), built on
    first use; None if kernels are off or it does not build."""
    if not kernels.native_kernels_enabled() or platform.system() != "Linux":
        return None
    try:
        return build(_SOURCE, isa)
    except (OSError, subprocess.CalledProcessError) as e:
        logger.warning("quantized GEMM kernel disabled: %s",
                       (getattr(e, "stderr", "") or str(e)).strip()[:500])
        return None


def build(source: str, isa: str | None = None) -> ctypes.CDLL:
    """``source`` (this file's ``quant_gemm.c`` or another version of it) built with the
    kernels' flags for ``isa`` (cached by content), loaded, its functions typed."""
    # (-I: a version of the source from elsewhere finds this folder's headers)
    flags = [*kernels._FLAGS, *kernels._isa_flags(isa or kernels.kernel_isa()),
             "-I", os.path.dirname(_SOURCE)]
    lib = small_library.build("quant", source, flags, _HEADERS)
    lib.qgemm_f32.restype = ctypes.c_int
    lib.qgemm_f32.argtypes = [_PTR, _I32, _I32, _I32, _PTR, _I32, _I32, _PTR, _PTR, _I32,
                              _PTR, _PTR, _I32, _I32]
    lib.qgemm_f32_simd.restype = ctypes.c_int
    lib.qgemm_f32_simd.argtypes = []
    lib.qgemm_a16.restype = ctypes.c_int
    lib.qgemm_a16.argtypes = [_PTR, _I32, _I32, _I32, _PTR, _I32, _PTR, _PTR, _I32, _PTR,
                              _PTR, _I32]
    lib.qgemm_a16_i8.restype = ctypes.c_int
    lib.qgemm_a16_i8.argtypes = lib.qgemm_a16.argtypes
    return lib


def simd() -> bool:
    """Whether the build has the AVX2 + FMA body (else the portable scalar one)."""
    lib = load()
    return bool(lib is not None and lib.qgemm_f32_simd())


def check_weight(qweight: torch.Tensor, bits: int, n: int, k: int, scales: torch.Tensor,
                 zeros: torch.Tensor | None, group: int, bias: torch.Tensor | None) -> None:
    """ValueError naming what is wrong unless the weight is one ``qgemm_f32`` takes for N = n
    outputs and K = k inputs, packed in panels of 16 outputs (``quant_gemm.c``): int8
    [P, K, 16], int4 uint8 [P, K, 8]; scales (and zeros) float32 [P, K / group, 16]."""
    if bits not in (4, 8):
        raise ValueError(f"conveyor::qgemm: bits must be 4 or 8, got {bits}")
    if group <= 0 or k % group:
        raise ValueError(f"conveyor::qgemm: group {group} does not divide K = {k}")
    want = torch.int8 if bits == 8 else torch.uint8
    panels = -(-n // 16)
    shape = (panels, k, 16 if bits == 8 else 8)
    if qweight.dtype != want or tuple(qweight.shape) != shape \
            or not qweight.is_contiguous() or qweight.device.type != "cpu":
        raise ValueError(f"conveyor::qgemm: a {bits}-bit weight must be a contiguous "
                         f"{want} CPU tensor {shape}, got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t is not None and (t.dtype != torch.float32 or not t.is_contiguous()
                              or tuple(t.shape) != (panels, k // group, 16)):
            raise ValueError(f"conveyor::qgemm: {name} must be contiguous float32 "
                             f"[{panels}, {k // group}, 16], got {t.dtype} {tuple(t.shape)}")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,)
                             or not bias.is_contiguous()):
        raise ValueError(f"conveyor::qgemm: bias must be contiguous float32 [{n}]")


class PackedQGemm:
    """A packed weight (``check_weight``'s layout) with its scales, zeros and bias, checked
    once: a call ``(x)`` checks only x, then runs ``qgemm_f32`` on the stored pointers (a
    decode step makes one call a projection, so the per-call Python is a share of it)."""

    __slots__ = ("_args", "_fn", "_keep", "glu", "in_features", "out_features", "width")

    def __init__(self, qweight: torch.Tensor, bits: int, scales: torch.Tensor,
                 zeros: torch.Tensor | None, group: int, bias: torch.Tensor | None, n: int,
                 k: int, lib=None, glu: bool = False) -> None:
        """``glu``: the weight is a [gate; up] projection of n = 2I rows (I a multiple of
        16, no bias) packed with its panels in pairs (gate 16i.., up 16i..: panels 2i and
        2i + 1); a call returns silu(gate) * up, [M, I]."""
        check_weight(qweight, bits, n, k, scales, zeros, group, bias)
        if glu and (n % 32 or bias is not None):
            raise ValueError(f"conveyor::qgemm: a fused gate/up projection needs 2I rows, I "
                             f"a multiple of 16, and no bias (got {n} rows)")
        lib = lib or load()
        if lib is None:
            raise RuntimeError("conveyor::qgemm: the quantized GEMM is not built "
                               + kernels.why_unavailable())
        self._fn = lib.qgemm_f32
        self._keep = (qweight, scales, zeros, bias)  # the pointers below stay valid
        self._args = (qweight.data_ptr(), bits, n, scales.data_ptr(),
                      zeros.data_ptr() if zeros is not None else None, group,
                      bias.data_ptr() if bias is not None else None)
        self.out_features, self.in_features = n, k
        self.glu = bool(glu)
        self.width = n // 2 if glu else n

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ dequant(W).T + bias`` for float32 x [M, K] on CPU, rows unit-stride."""
        k, n = self.in_features, self.out_features
        if x.dtype is not torch.float32 or x.dim() != 2 or x.shape[1] != k \
                or x.stride(1) != 1 or not x.is_cpu or x.stride(0) > _INT_MAX:
            raise ValueError(f"conveyor::qgemm: x must be float32 [M, {k}] on CPU with unit "
                             f"column stride, got {x.dtype} {tuple(x.shape)}")
        m, width = x.shape[0], self.width
        y = torch.empty(m, width, dtype=torch.float32)
        if m == 0:
            return y
        w, bits, _, s, z, group, b = self._args
        rc = self._fn(x.data_ptr(), m, k, x.stride(0), w, bits, n, s, z, group, b,
                      y.data_ptr(), width, int(self.glu))
        if rc == -2:
            raise MemoryError("conveyor::qgemm: no memory for the widening buffer")
        if rc != 0:
            raise ValueError("conveyor::qgemm: the kernel refused its arguments")
        return y


A16_MAX_GROUP = 4096  # qgemm_a16's int32 sums stay exact up to this group size
# qgemm_a16_i8 sums blocks of 512 columns in int32 (any group); its sums of x per group
# stay exact up to this size
A16_I8_MAX_GROUP = 65536


def a16_takes(k: int, group: int, bits: int = 4) -> bool:
    """Whether ``qgemm_a16`` (``bits`` 4) or ``qgemm_a16_i8`` (8) takes a weight of ``k``
    columns in groups of ``group``."""
    cap = A16_MAX_GROUP if bits == 4 else A16_I8_MAX_GROUP
    return (bits in (4, 8) and k % 2 == 0 and group % 2 == 0 and 0 < group <= cap
            and k % group == 0)


class PackedA16Gemm:
    """An int4 weight in ``qgemm_a16``'s column-pair layout (uint8 [P, K / 2, 16]), or an
    int8 one in ``qgemm_a16_i8``'s (int8 [P, K / 2, 32]), with its scales, zeros and bias,
    checked once; a call ``(x)`` rounds x to int16 per row in C (``quant_gemm.c``: the
    error bound) and sums the products in int32."""

    __slots__ = ("_args", "_fn", "_keep", "bits", "in_features", "out_features", "width")

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor,
                 zeros: torch.Tensor | None, group: int, bias: torch.Tensor | None, n: int,
                 k: int, lib=None, bits: int = 4) -> None:
        panels = -(-n // 16)
        if not a16_takes(k, group, bits):
            raise ValueError(f"conveyor::qgemm_a16: int{bits}, K = {k} and group {group}: "
                             "bits must be 4 or 8, K and the group even, the group "
                             "dividing K and at most "
                             f"{A16_MAX_GROUP if bits == 4 else A16_I8_MAX_GROUP}")
        want, shape = ((torch.uint8, (panels, k // 2, 16)) if bits == 4
                       else (torch.int8, (panels, k // 2, 32)))
        if qweight.dtype != want or tuple(qweight.shape) != shape \
                or not qweight.is_contiguous():
            raise ValueError(f"conveyor::qgemm_a16: the int{bits} weight must be contiguous "
                             f"{want} {shape}, got {qweight.dtype} "
                             f"{tuple(qweight.shape)}")
        # (scales, zeros and bias as qgemm_f32 takes them: its checks, on the panel shape)
        check_weight(torch.empty(panels, k, 8, dtype=torch.uint8), 4, n, k, scales, zeros,
                     group, bias)
        lib = lib or load()
        if lib is None:
            raise RuntimeError("conveyor::qgemm_a16: the quantized GEMM is not built "
                               + kernels.why_unavailable())
        self._fn = lib.qgemm_a16 if bits == 4 else lib.qgemm_a16_i8
        self.bits = bits
        self._keep = (qweight, scales, zeros, bias)
        self._args = (qweight.data_ptr(), n, scales.data_ptr(),
                      zeros.data_ptr() if zeros is not None else None, group,
                      bias.data_ptr() if bias is not None else None)
        self.out_features = self.width = n
        self.in_features = k

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        k, n = self.in_features, self.out_features
        if x.dtype is not torch.float32 or x.dim() != 2 or x.shape[1] != k \
                or x.stride(1) != 1 or not x.is_cpu or x.stride(0) > _INT_MAX:
            raise ValueError(f"conveyor::qgemm_a16: x must be float32 [M, {k}] on CPU with "
                             f"unit column stride, got {x.dtype} {tuple(x.shape)}")
        m = x.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        if m == 0:
            return y
        w, _, s, z, group, b = self._args
        rc = self._fn(x.data_ptr(), m, k, x.stride(0), w, n, s, z, group, b, y.data_ptr(), n)
        if rc == -2:
            raise MemoryError("conveyor::qgemm_a16: no memory for x's int16 copy")
        if rc != 0:
            raise ValueError("conveyor::qgemm_a16: the kernel refused its arguments")
        return y
