"""Freed activation memory stays in the process (runner/host_memory.py): once the mallopt
settings are in, a 25 MB block (a prefill's gate/up output) comes from the heap rather
than its own mmap, and freeing it leaves the pages with the process instead of trimming
them back to the OS, so the next step does not fault them in again. Read from glibc's
own accounting (mallinfo2) in a fresh interpreter: malloc settings are per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conveyor.runner import host_memory

PROBE = r"""
import ctypes, json, torch
from conveyor.runner.host_memory import keep_freed_host_memory
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
applied = keep_freed_host_memory()
x = torch.empty(25 << 18)  # 25 MiB of float32
x.fill_(1.0)
mmapped = libc.mallinfo2().hblkhd
del x
free_in_heap = libc.mallinfo2().fordblks
print(json.dumps({"applied": applied, "mmapped": mmapped, "free_in_heap": free_in_heap}))
"""
MiB = 1 << 20


def probe(keep: str) -> dict:
    env = {**os.environ, "CONVEYOR_KEEP_HOST_MEMORY": keep, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, timeout=120)
    if out.returncode != 0 and "mallinfo2" in out.stderr:
        pytest.skip("no glibc mallinfo2 here")
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_large_block_comes_from_the_heap_and_stays_there() -> None:
    kept = probe("1")
    if not kept["applied"]:
        pytest.skip("this libc has no mallopt to tune (not glibc)")
    assert kept["mmapped"] < 25 * MiB, kept  # not an mmap of its own (munmapped on free)
    assert kept["free_in_heap"] >= 25 * MiB, kept  # freed, not trimmed off the heap


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_switched_off_leaves_malloc_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    plain = probe("0")
    assert plain["applied"] is False
    assert plain["mmapped"] >= 25 * MiB, plain  # glibc's default: its own mmap
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setenv("CONVEYOR_KEEP_HOST_MEMORY", "off")
    assert host_memory.keep_freed_host_memory() is False
