"""The typed messages between a tensor-parallel executor and its rank workers (no torch).

    executor (engine-core process)                  rank worker (one per rank)
    ------------------------------                  --------------------------
                                        <-------    WorkerReady(rank, model, device)
    SizeKVCache(cache, max_num_seqs)    ------->    KVCacheSized(num_blocks)
    InitializeWorker(config)            ------->    WorkerInitialized(rank, KV pool shape)
    ExecuteModel(scheduler_output)      ------->    ModelExecuted(output: rank 0 only)
    ShutdownWorker()                    ------->    (exits)
                                        <-------    WorkerFailed(rank, message), any time

Every rank gets every command (the core's ``SchedulerOutput`` is broadcast) and answers
each, so that a rank that fails is noticed at once instead of through a hung collective.
msgspec Structs encoded as msgpack, with the core's dataclasses inside: no pickle per step.
"""

from __future__ import annotations

import msgspec

from conveyor.config import CacheConfig, EngineConfig, ModelConfig
from conveyor.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


class SizeKVCache(msgspec.Struct, tag=True, array_like=True):
    cache: CacheConfig
    max_num_seqs: int


class InitializeWorker(msgspec.Struct, tag=True, array_like=True):
    config: EngineConfig


class ExecuteModel(msgspec.Struct, tag=True, array_like=True):
    scheduler_output: SchedulerOutput


class ShutdownWorker(msgspec.Struct, tag=True, array_like=True):
    pass


WorkerCommand = SizeKVCache | InitializeWorker | ExecuteModel | ShutdownWorker


class WorkerReady(msgspec.Struct, tag=True, array_like=True):
    rank: int
    model: ModelConfig  # as the rank resolved it (compute dtype), the full model's shape
    device: str


class KVCacheSized(msgspec.Struct, tag=True, array_like=True):
    num_blocks: int


class WorkerInitialized(msgspec.Struct, tag=True, array_like=True):
    """A rank's KV pool: ``[slots, kv heads, head dim]`` per layer, and which global KV
    heads (and query heads) it holds."""

    rank: int
    kv_cache_shape: list[int]
    kv_heads: list[int]
    q_heads: list[int]


class ModelExecuted(msgspec.Struct, tag=True, array_like=True):
    output: ModelRunnerOutput | None = None  # rank 0's; the others sampled the same
    # Every rank's own adapter loads (each reads its shard): ready when all are.
    lora_loaded: list[int] = []
    lora_failed: dict[int, str] = {}


class WorkerFailed(msgspec.Struct, tag=True, array_like=True):
    rank: int
    message: str


WorkerReply = WorkerReady | KVCacheSized | WorkerInitialized | ModelExecuted | WorkerFailed

_encoder = msgspec.msgpack.Encoder()


def encode(msg: WorkerCommand | WorkerReply) -> bytes:
    return _encoder.encode(msg)


command_decoder = msgspec.msgpack.Decoder(WorkerCommand).decode
reply_decoder = msgspec.msgpack.Decoder(WorkerReply).decode
