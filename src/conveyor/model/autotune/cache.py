"""What the backend choices measured on this machine (linears, attention) share: the
timing, the switch that turns measuring off, the key of a choice (this machine's CPU,
flags, torch and threads, then the choice's own parts) and the on-disk cache (one JSON
file per kind under ``<cache>/``, written atomically so that engines starting at once
never read half a file; an unwritable cache is logged, never fatal)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable

import torch

from conveyor import envs
from conveyor.kernels import cpu as kernels
from conveyor.kernels.cpu.cpuinfo import cpu_flags, cpu_model_name

logger = logging.getLogger(__name__)


def best_of(fn: Callable[[], object], repeats: int = 3) -> float:
    """The fastest of ``repeats`` timed calls, after one untimed (kernels built, buffers
    faulted in)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def key(*parts: str) -> str:
    """A choice's cache key: this machine and its torch, then ``parts``."""
    machine = [cpu_model_name(), " ".join(sorted(cpu_flags() or ())), torch.__version__,
               str(torch.get_num_threads())]
    return hashlib.sha256("|".join([*machine, *parts]).encode()).hexdigest()[:24]


def kernel_build() -> str:
    """The native kernels' build key (sources, flags, ISA), a part of every key whose
    choice can land on them: a changed kernel is measured afresh, not judged by the timings
    of the one it replaced."""
    return kernels.build_key() if kernels.native_kernels_enabled() else "no-native"


def _path(kind: str) -> str:
    return os.path.join(envs.cache_root(), f"{kind}_choice.json")


def read(kind: str) -> dict:
    """Every entry cached for ``kind`` (``{}`` if none or unreadable)."""
    try:
        with open(_path(kind)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def store(kind: str, key: str, entry: dict) -> None:
    """Add ``entry`` under ``key`` (a re-read of the file first: another engine may have
    written since)."""
    cache = read(kind)
    cache[key] = entry
    path = _path(kind)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(cache, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not cache the %s backend choice: %s", kind, e)
