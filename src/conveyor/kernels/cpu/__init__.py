"""Native CPU kernels, compiled on first use with the system C compiler and loaded by ctypes.

Only plain C with OpenMP (no torch headers), so a build takes well under a second. The
shared object is cached under ``~/.cache/conveyor/kernels/<key>/`` where the key covers
the source, the flags and this CPU's instruction set (it is built with -march=native).
OpenMP resolves to the libgomp that torch has already loaded, so the kernels and torch
share one thread pool and ``torch.set_num_threads`` governs both.

Without a compiler, or with ``CONVEYOR_NATIVE_KERNELS=0`` in the environment, ``load()``
returns None and callers fall back to PyTorch ops (CI runs the exactness and engine tests
that way too, so the fallback path stays tested).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

from conveyor import envs
from conveyor.kernels.cpu.cpuinfo import cpu_flags

logger = logging.getLogger(__name__)

_SOURCES = [os.path.join(os.path.dirname(__file__), name)
            for name in ("decode_attention.c", "prefill_attention.c",
                         "prefill_attention_amx.c", "elementwise.c", "gemm.c",
                         "draft_forward.c", "decode_forward.c", "kv_store.c")]
_HEADERS = [os.path.join(os.path.dirname(__file__), name)
            for name in ("prefill_attention_body.h", "prefill_attention_avx2.h",
                         "prefill_attention_avx512.h", "prefill_attention_dims.h", "simd_math.h",
                         "simd_exp.h", "bf16.h", "amx_emulation.h",
                         "transpose16.h", "kv_quant.h", "softcap.h")]
# -ffast-math only while compiling: linking with it would add crtfastmath, whose
# constructor turns on flush-to-zero for the whole process (torch included).
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
_LIBS = ["-lmvec", "-lm"]
# Sources whose arithmetic must be IEEE's as written (after _FLAGS: these win): the KV
# cache's quantizing write divides as torch does, to write the bytes it would.
SOURCE_FLAGS = {"kv_store.c": ["-fno-fast-math", "-ffp-contract=off"]}
# CONVEYOR_KERNEL_ISA caps the instruction set the kernels are built for (tests and
# benchmarks use it to run the AVX2 and portable bodies on an AVX-512 machine).
# "avx512bf16" is the native build less AMX (on a CPU with AMX tiles: the AVX-512 BF16
# bodies it would otherwise skip); the AMX flags are passed only where the CPU has AMX
# (_isa_flags), so a compiler too old to know them still builds every cap elsewhere.
_NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16"]
ISA_FLAGS = {"native": [], "avx512bf16": _NO_AMX, "avx512": ["-mno-avx512bf16", *_NO_AMX],
             "avx2": ["-mno-avx512f", *_NO_AMX],
             "portable": ["-mno-avx512f", "-mno-avx2", "-mno-fma", *_NO_AMX],
             # tests only: the AMX body on scalar tiles (amx_emulation.h), where the CPU
             # has AVX-512 BF16 and no AMX; orders of magnitude slower than the real thing
             "amx-emulated": ["-DCONVEYOR_EMULATE_AMX", *_NO_AMX]}
_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_key() -> str:
    return platform.machine() + " ".join(sorted(cpu_flags() or ()))


def native_kernels_enabled() -> bool:
    """False when ``CONVEYOR_NATIVE_KERNELS`` says no (0, false, off, no)."""
    return envs.switched_on(envs.NATIVE_KERNELS)


def why_unavailable() -> str:
    """Why ``load()`` returned None, for error messages."""
    if not native_kernels_enabled():
        return "(CONVEYOR_NATIVE_KERNELS=0 turns them off)"
    return "(no C compiler, or the build failed: see the log)"


def kernel_isa() -> str:
    """The instruction-set cap of ``CONVEYOR_KERNEL_ISA`` (native, avx512bf16: native
    less AMX, avx512: less AVX-512 BF16 too, avx2, portable; amx-emulated: the native
    build with the AMX body on scalar tiles, for tests)."""
    isa = envs.kernel_isa()
    if isa not in ISA_FLAGS:
        raise ValueError(f"CONVEYOR_KERNEL_ISA={isa!r}: expected one of {sorted(ISA_FLAGS)}")
    return isa


def isa_builds() -> list[str]:
    """The builds this CPU runs (``ISA_FLAGS`` keys): its own, and each cap below what it
    has, so that one machine can check the bodies another CPU would run; with AVX-512
    BF16 and no AMX, the AMX body on emulated tiles too."""
    flags = cpu_flags() or frozenset()
    return ["native"] + (["avx512bf16"] if "amx_bf16" in flags else []) + (
        ["amx-emulated"] if "avx512_bf16" in flags and "amx_bf16" not in flags else []) + (
        ["avx512"] if "avx512_bf16" in flags else []) + (
        ["avx2"] if {"avx512f", "avx2"} <= flags else []) + (
        ["portable"] if "avx2" in flags else [])


def bf16_prefill_rounds_probabilities(isa: str | None = None) -> bool:
    """Whether the build's bf16 prefill attention rounds the softmax numerators to bf16
    for P @ V (as torch's CPU flash attention does in bf16): the AVX-512 BF16 body and the
    AMX body, which a native build (or one capped below AMX) gets where the CPU has the
    instructions. Its error bound is wider."""
    return (isa or kernel_isa()) in ("native", "avx512bf16", "amx-emulated") and "avx512_bf16" in (
        cpu_flags() or ())


def _isa_flags(isa: str) -> list[str]:
    """The cap's compiler flags, less the AMX ones on a CPU without AMX (where
    -march=native enables none)."""
    if "amx_tile" in (cpu_flags() or ()):
        return ISA_FLAGS[isa]
    return [f for f in ISA_FLAGS[isa] if f not in _NO_AMX]


def build_key(isa: str | None = None) -> str:
    """The build's cache key: sources, flags and this CPU's instruction set (measured
    backend choices are keyed by it too: a changed kernel is measured afresh)."""
    return _build_key(isa or kernel_isa())


@functools.cache
def _build_key(isa: str) -> str:  # the sources do not change under a running process
    flags = [*_FLAGS, *_isa_flags(isa)]
    key = hashlib.sha256(" ".join(flags).encode() + _cpu_key().encode()
                         + repr(sorted(SOURCE_FLAGS.items())).encode())
    for source in [*_SOURCES, *_HEADERS]:
        with open(source, "rb") as f:
            key.update(f.read())
    return key.hexdigest()[:16]


def _build(compiler: str, out_path: str, flags: list[str]) -> None:
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    workdir = tempfile.mkdtemp(dir=os.path.dirname(out_path))
    try:
        objects = []
        for source in _SOURCES:
            obj = os.path.join(workdir, os.path.basename(source) + ".o")
            own = SOURCE_FLAGS.get(os.path.basename(source), [])
            subprocess.run([compiler, *flags, *own, "-c", source, "-o", obj], check=True,
                           capture_output=True, text=True)
            objects.append(obj)
        tmp = os.path.join(workdir, "lib.so")
        link = [compiler, "-shared", "-fopenmp", *objects, "-o", tmp]
        try:
            subprocess.run([*link, *_LIBS], check=True, capture_output=True, text=True)
        except subprocess.CalledProcessError:
            # No libmvec (non-glibc): the exponentials stay scalar.
            subprocess.run([*link, "-lm"], check=True, capture_output=True, text=True)
        os.replace(tmp, out_path)  # atomic: concurrent builders never see half a file
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def find_compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc, else gcc; None if none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build_for(march: str, isa: str, out_path: str) -> None:
    """Build the library as a CPU of ``-march=march`` would (capped at ``isa``), without
    loading it: tests compile the bodies of CPUs the session does not have (AMX on an
    AMD machine), so a change that breaks another CPU's build fails here, not there.
    Raises CalledProcessError (its ``stderr``: the compiler's) if it does not build."""
    compiler = find_compiler()
    if compiler is None:
        raise FileNotFoundError("no C compiler")
    flags = [f"-march={march}" if f == "-march=native" else f for f in _FLAGS]
    _build(compiler, out_path, [*flags, *ISA_FLAGS[isa]])


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, building it if needed; None if it cannot be built."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if not native_kernels_enabled():
        logger.info("native CPU kernels disabled by CONVEYOR_NATIVE_KERNELS=0")
        return None
    _lib = load_variant(kernel_isa())
    return _lib


def load_variant(isa: str) -> ctypes.CDLL | None:
    """A build of the library for ``isa`` (``ISA_FLAGS``: native, or capped below AMX, at
    AVX-512 without BF16, at AVX2 or at portable C), loaded beside any other; None if it
    cannot be built."""
    if platform.system() != "Linux":
        return None
    compiler = find_compiler()
    if compiler is None:
        logger.warning("no C compiler found: native CPU kernels disabled")
        return None
    flags = [*_FLAGS, *_isa_flags(isa)]
    path = os.path.join(envs.cache_root(), "kernels", build_key(isa), "libconveyor_cpu.so")
    try:
        if not os.path.isfile(path):
            _build(compiler, path, flags)
        import torch  # noqa: F401  (load torch's libgomp first so the kernels share it)

        lib = ctypes.CDLL(path)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("native CPU kernels disabled: %s", detail.strip()[:500])
        return None
    bind(lib)
    return lib


_PTR, _I32, _F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# Each exported function's argument types, and its result type where it returns one.
SIGNATURES: dict[str, list] = {
    "decode_attention_f32": [_PTR] * 7 + [_I32] * 5 + [_F32],
    "decode_attention_bf16": [_PTR] * 7 + [_I32] * 5 + [_F32],
    # (the generic bodies alone: tests and benchmarks/kernels/decode_attention_kernel.py)
    "decode_attention_f32_generic": [_PTR] * 7 + [_I32] * 5 + [_F32],
    "decode_attention_bf16_generic": [_PTR] * 7 + [_I32] * 5 + [_F32],
    # a one-byte cache: codes and scales of K and V, then as above, then its kind
    "decode_attention_q8": [_PTR] * 9 + [_I32] * 5 + [_F32, _I32],
    "decode_attention_q8_generic": [_PTR] * 9 + [_I32] * 5 + [_F32, _I32],
    # the same with Gemma 2's logit cap last (softcap.h; 0: none)
    "decode_attention_f32_capped": [_PTR] * 7 + [_I32] * 5 + [_F32] * 2,
    "decode_attention_bf16_capped": [_PTR] * 7 + [_I32] * 5 + [_F32] * 2,
    "decode_attention_f32_generic_capped": [_PTR] * 7 + [_I32] * 5 + [_F32] * 2,
    "decode_attention_bf16_generic_capped": [_PTR] * 7 + [_I32] * 5 + [_F32] * 2,
    "decode_attention_q8_capped": [_PTR] * 9 + [_I32] * 5 + [_F32, _I32, _F32],
    "decode_attention_q8_generic_capped": [_PTR] * 9 + [_I32] * 5 + [_F32, _I32, _F32],
    "kv_dequant": [_PTR] * 2 + [_I32] * 3,
    "kv_store_q8": [_PTR, ctypes.c_int64, _I32, _PTR] + [_I32] * 3 + [_PTR] * 2 + [_I32],
    "rms_norm_f32": [_PTR] * 3 + [_I32] * 2 + [_F32],
    "add_rms_norm_f32": [_PTR] * 4 + [_I32] * 2 + [_F32],
    "silu_mul_f32": [_PTR] * 2 + [_I32] * 2,
    "gelu_tanh_mul_f32": [_PTR] * 2 + [_I32] * 2,
    "softcap_f32": [_PTR, ctypes.c_int64, _F32],
    "rope_f32": [_PTR] * 4 + [_I32] * 4,
    "rms_norm_bf16": [_PTR] * 3 + [_I32] * 2 + [_F32],
    "add_rms_norm_bf16": [_PTR] * 4 + [_I32] * 2 + [_F32],
    "silu_mul_bf16": [_PTR] * 2 + [_I32] * 2,
    "rope_bf16": [_PTR] * 4 + [_I32] * 4,
    "prefill_attention_f32": [_PTR] * 4 + [_I32] * 7 + [_F32],
    "prefill_attention_bf16": [_PTR] * 4 + [_I32] * 7 + [_F32],
    "prefill_attention_varlen_f32": [_PTR] * 6 + [_I32] * 7 + [_F32],
    "prefill_attention_varlen_bf16": [_PTR] * 6 + [_I32] * 7 + [_F32],
    "prefill_attention_f32_capped": [_PTR] * 4 + [_I32] * 7 + [_F32] * 2,
    "prefill_attention_bf16_capped": [_PTR] * 4 + [_I32] * 7 + [_F32] * 2,
    "prefill_attention_varlen_f32_capped": [_PTR] * 6 + [_I32] * 7 + [_F32] * 2,
    "prefill_attention_varlen_bf16_capped": [_PTR] * 6 + [_I32] * 7 + [_F32] * 2,
    "gemm_f32_available": [],
    "amx_tiles_available": [],
    "gemm_packed_size": [_I32] * 3,
    "gemm_pack_weight_f32": [_PTR] * 2 + [_I32] * 3,
    "gemm_f32": [_PTR, _I32, _PTR, _PTR, _PTR] + [_I32] * 5,
    "gemm_pack_weight_bf16": [_PTR] * 2 + [_I32] * 3,
    "gemm_f32_w16": [_PTR, _I32, _PTR, _PTR, _PTR] + [_I32] * 5,
    "gemm_f32_grouped": [_I32, _PTR, _I32, _PTR, _I32, _PTR, _I32, _PTR] + [_I32] * 3,
    "draft_propose_f32": [_PTR, _PTR, _F32, _F32, _I32] + [_PTR] * 5 + [_I32, _PTR],
    "decode_forward_f32": [_PTR] * 2 + [_F32, _F32, _I32] + [_PTR] * 6 + [_I32, _PTR],
    "decode_linears_time": [_PTR, _I32, _PTR, _I32] + [_PTR] * 3 + [_I32, _PTR],
}
RESTYPES = {"prefill_attention_f32": ctypes.c_int, "prefill_attention_bf16": ctypes.c_int,
            "prefill_attention_varlen_f32": ctypes.c_int,
            "prefill_attention_varlen_bf16": ctypes.c_int,
            "prefill_attention_f32_capped": ctypes.c_int,
            "prefill_attention_bf16_capped": ctypes.c_int,
            "prefill_attention_varlen_f32_capped": ctypes.c_int,
            "prefill_attention_varlen_bf16_capped": ctypes.c_int,
            "gemm_f32_available": ctypes.c_int, "amx_tiles_available": ctypes.c_int,
            "gemm_packed_size": ctypes.c_int64,
            "gemm_f32": ctypes.c_int, "gemm_f32_w16": ctypes.c_int,
            "gemm_f32_grouped": ctypes.c_int,
            "draft_propose_f32": ctypes.c_int, "decode_forward_f32": ctypes.c_int,
            "decode_linears_time": ctypes.c_int}


def bind(lib: ctypes.CDLL, only_present: bool = False) -> None:
    """Give ``lib``'s functions their C types; ``only_present``: skip those it lacks (a
    library of some of the sources: benchmarks/common.py)."""
    for name, argtypes in SIGNATURES.items():
        if only_present and not hasattr(lib, name):
            continue
        fn = getattr(lib, name)
        fn.restype = RESTYPES.get(name)
        fn.argtypes = argtypes
