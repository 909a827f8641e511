"""What this machine's CPU is and can do, from /proc/cpuinfo: the flags that pick the
kernels' instruction set, and the model name every measured figure is labelled with."""

from __future__ import annotations

import functools
import platform


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (x86 ``flags``, Arm ``Features``), or None
    where there is no /proc."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(flag for line in f if line.startswith(("flags", "Features"))
                             for flag in line.split(":", 1)[1].split())
    except OSError:
        return None


def cpuinfo_field(name: str) -> str | None:
    """The first value of /proc/cpuinfo's field ``name`` (exactly: ``model`` is not
    ``model name``), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_model_name() -> str:
    """/proc/cpuinfo's model name (what every measured figure is labelled with)."""
    return cpuinfo_field("model name") or platform.processor() or platform.machine()
