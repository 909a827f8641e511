"""Every ``CONVEYOR_*`` environment variable, documented and read here alone.

Each variable is read when its function is called (not at import), so a test that sets
one with ``monkeypatch.setenv`` sees it take effect. Switches are on unless the variable
says 0, false, off or no.

| variable | default | what it does |
|---|---|---|
| ``CONVEYOR_CACHE`` | ``~/.cache/conveyor`` | measured choices, built kernels, presets |
| ``CONVEYOR_NATIVE_KERNELS`` | on | the native C kernels; off: every backend falls back to torch |
| ``CONVEYOR_KERNEL_ISA`` | ``native`` | caps the instruction set the C kernels are built for |
| ``CONVEYOR_MEASURE_LINEARS`` | on | measure linear backends at start; off: static priority |
| ``CONVEYOR_MEASURE_ATTENTION`` | on | measure attention backends at start; off: priority order |
| ``CONVEYOR_FEW_ROWS`` | unset | force the few-rows GEMM split at N rows (0: none) |
| ``CONVEYOR_NATIVE_DRAFT`` | on | a float32 draft model's greedy proposals as one native loop |
| ``CONVEYOR_FUSED_DECODE`` | on | a Llama-family model's small decode steps as one native call |
| ``CONVEYOR_KEEP_HOST_MEMORY`` | on | keep freed activation memory mapped between steps |
| ``CONVEYOR_HUGE_PAGES`` | on | advise transparent huge pages for the KV cache and weights |
| ``CONVEYOR_GC_FREEZE`` | on | freeze the start-up heap out of Python's garbage collector |
| ``CONVEYOR_API_KEY`` | unset | the bearer key the OpenAI server (and router replicas) require |
| ``CONVEYOR_KV_FAULT`` | unset | tests only: fault injection in the disaggregated KV transport |
"""

from __future__ import annotations

import os

_OFF = ("0", "false", "off", "no")

CACHE = "CONVEYOR_CACHE"
NATIVE_KERNELS = "CONVEYOR_NATIVE_KERNELS"
KERNEL_ISA = "CONVEYOR_KERNEL_ISA"
MEASURE_LINEARS = "CONVEYOR_MEASURE_LINEARS"
MEASURE_ATTENTION = "CONVEYOR_MEASURE_ATTENTION"
FEW_ROWS = "CONVEYOR_FEW_ROWS"
NATIVE_DRAFT = "CONVEYOR_NATIVE_DRAFT"
FUSED_DECODE = "CONVEYOR_FUSED_DECODE"
KEEP_HOST_MEMORY = "CONVEYOR_KEEP_HOST_MEMORY"
HUGE_PAGES = "CONVEYOR_HUGE_PAGES"
GC_FREEZE = "CONVEYOR_GC_FREEZE"
API_KEY = "CONVEYOR_API_KEY"
KV_FAULT = "CONVEYOR_KV_FAULT"


def switched_on(name: str) -> bool:
    """A switch is on unless its variable says 0, false, off or no."""
    return os.environ.get(name, "1").strip().lower() not in _OFF


def cache_root() -> str:
    return os.environ.get(CACHE) or os.path.join(os.path.expanduser("~"), ".cache", "conveyor")


def kernel_isa() -> str:
    """The raw ``CONVEYOR_KERNEL_ISA`` value, lower case (``native`` when unset)."""
    return os.environ.get(KERNEL_ISA, "native").strip().lower() or "native"


def few_rows() -> int | None:
    value = os.environ.get(FEW_ROWS, "").strip()
    return int(value) if value else None


def api_key() -> str | None:
    return os.environ.get(API_KEY) or None


def kv_fault() -> str:
    return os.environ.get(KV_FAULT, "").strip()
