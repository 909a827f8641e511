"""Build one small kernel library of its own (the quantized GEMM, prompt logprobs' rows,
the token bitmask): the main library's compiler and cache root, its own cache key, so a
change to one source rebuilds only that library.

The object is compiled with the caller's flags and linked without them: linking with
-ffast-math adds crtfastmath, whose constructor flushes subnormals to zero for the whole
process (torch included) as soon as the library loads.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess

from conveyor import envs
from conveyor.kernels import cpu as kernels


def cache_key(source: str, flags: list[str], headers: tuple[str, ...] = ()) -> str:
    """The build's key: its flags, this CPU, and the bytes of ``source`` and ``headers``."""
    digest = hashlib.sha256(" ".join(flags).encode() + kernels._cpu_key().encode()
                            + b"linked-apart")
    for path in (source, *headers):
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def build(stem: str, source: str, flags: list[str], headers: tuple[str, ...] = ()
          ) -> ctypes.CDLL:
    """``source`` built with ``flags`` as ``libconveyor_<stem>.so`` under the kernels'
    cache root (reused while its key holds), then loaded. Raises OSError (no compiler, a
    load failure) or CalledProcessError (a compile or link failure, its stderr kept)."""
    compiler = kernels.find_compiler()
    if compiler is None:
        raise OSError("no C compiler")
    path = os.path.join(envs.cache_root(), "kernels",
                        f"{stem}-{cache_key(source, flags, headers)}", f"libconveyor_{stem}.so")
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        obj = f"{tmp}.o"
        subprocess.run([compiler, *flags, "-c", source, "-o", obj],
                       check=True, capture_output=True, text=True)
        subprocess.run([compiler, "-shared", "-fopenmp", obj, "-o", tmp, "-lm"],
                       check=True, capture_output=True, text=True)
        os.remove(obj)
        os.replace(tmp, path)  # atomic: concurrent builders never see half a file
    import torch  # noqa: F401  (torch's libgomp first: one OpenMP thread pool)

    return ctypes.CDLL(path)
