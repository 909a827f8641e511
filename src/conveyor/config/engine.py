"""The frozen engine configuration, derived once from the args and what the executor found."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from conveyor.config.cache import CacheConfig
from conveyor.config.kv_transfer import KVTransferConfig
from conveyor.config.lora import LoRAConfig
from conveyor.config.model import ModelConfig
from conveyor.config.scheduler import SchedulerConfig

if TYPE_CHECKING:
    from conveyor.config.args import EngineArgs


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str
    num_threads: int | None = None
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    tensor_parallel_size: int = 1
    lora: LoRAConfig | None = None  # multi-LoRA (None: off)


def resolve_engine_config(args: EngineArgs, model: ModelConfig, num_kv_blocks: int,
                          device: str) -> EngineConfig:
    """The one derivation of the frozen ``EngineConfig``, shared by the engine, the simulator
    and the bench: the engine args, the model as the executor resolved it (its compute
    dtype), and the KV pool the executor can hold, which caps the longest sequence."""
    cache = dataclasses.replace(args.cache_config(), num_kv_blocks=num_kv_blocks)
    max_len = min(model.max_model_len, num_kv_blocks * cache.block_size)
    return EngineConfig(model=dataclasses.replace(model, max_model_len=max_len), cache=cache,
                        scheduler=args.scheduler_config(), device=device,
                        num_threads=args.num_threads,
                        kv_transfer=args.kv_transfer_config(),
                        tensor_parallel_size=args.tensor_parallel_size,
                        lora=args.lora_config())

