"""Multi-LoRA serving's options and the adapter a request names (torch-free).

``LoRARequest(name, id, path)`` is vLLM's: the adapter's name (what a request's ``model``
says), a positive integer id unique per adapter (the scheduler, the prefix cache and the
runner key on it) and the folder of a PEFT checkpoint (``adapter_config.json`` and
``adapter_model.safetensors``). ``check_adapter`` reads the config only, so the front end
refuses a missing file or a rank above ``--max-lora-rank`` before anything is queued.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import msgspec

# The projections an adapter may target: the decoder's q/k/v (packed into qkv_proj),
# o_proj, gate/up (packed into gate_up_proj) and down_proj.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class LoRARequest(msgspec.Struct, array_like=True, frozen=True):
    """An adapter for a request: ``LoRARequest("sql", 1, "/adapters/sql")``."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (0 is the base model), "
                             f"got {self.lora_int_id}")


@dataclass(frozen=True)
class LoRAConfig:
    """``max_loras``: adapters in one step (the scheduler's constraint); ``max_lora_rank``:
    the largest rank accepted; ``max_cpu_loras``: adapters kept loaded (least recently
    used dropped first, never one in use); ``modules``: (name, path) served from start."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras})")

    @property
    def cache_size(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def parse_lora_modules(items: list[str] | dict[str, str] | None) -> tuple[tuple[str, str], ...]:
    """``--lora-modules name=path ...`` (or a dict) as (name, path) pairs."""
    if not items:
        return ()
    if isinstance(items, dict):
        return tuple(items.items())
    out = []
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path, got {item!r}")
        out.append((name, path))
    return tuple(out)


def check_adapter(path: str, max_rank: int) -> dict:
    """The adapter's ``adapter_config.json`` if it can be served, else ValueError naming
    why: no such folder or file, not a LoRA, a rank above ``max_rank``, a target or
    variant conveyor does not apply (DoRA, LoRA on biases or embeddings)."""
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"no adapter_config.json in {path!r}")
    if not any(os.path.isfile(os.path.join(path, f)) for f in WEIGHT_FILES):
        raise ValueError(f"no adapter weights ({' or '.join(WEIGHT_FILES)}) in {path!r}")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter {path!r} is {cfg.get('peft_type')}, not LORA")
    ranks = [int(cfg.get("r", 8)), *map(int, (cfg.get("rank_pattern") or {}).values())]
    if max(ranks) > max_rank:
        raise ValueError(f"adapter {path!r} has rank {max(ranks)}, above --max-lora-rank "
                         f"{max_rank}")
    for flag in ("use_dora", "lora_bias"):
        if cfg.get(flag):
            raise ValueError(f"adapter {path!r}: {flag} is not supported")
    return cfg


def lora_tenant(tenant: str, lora_request: LoRARequest | None) -> str:
    """The tenant a request counts under: its own, else its adapter's (``lora:NAME``), so
    that the fair policy shares the engine across adapters as across tenants."""
    if tenant == "default" and lora_request is not None:
        return f"lora:{lora_request.lora_name}"
    return tenant


def lora_hash_key(extra_key: bytes, lora_id: int) -> bytes:
    """The prefix cache's salt for an adapter's requests: its K/V differs from the base
    model's for the same tokens, so blocks are shared only within one adapter."""
    return extra_key if not lora_id else extra_key + b"|lora:%d" % lora_id
