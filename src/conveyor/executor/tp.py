"""The executor side of tensor parallelism, whatever places the ranks.

The core runs once and calls this like a ``LocalExecutor``; each call becomes one
``tp_messages`` command sent to every rank and one reply from each (``_call``, which a
placement implements: ``multiproc.py`` over pipes, ``ray_executor.py`` over Ray). Only
rank 0's ``ModelRunnerOutput`` comes back to the core.

A rank that dies, fails, or does not answer within ``distributed_timeout_s`` ends the
executor (``ExecutorDeadError``): every rank is stopped, the engine loop fails every
open request and stops, and ``/health`` answers 503. Nothing waits on a hung collective.
"""

from __future__ import annotations

import logging

from conveyor.config import CacheConfig, EngineArgs, EngineConfig, ModelConfig
from conveyor.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from conveyor.distributed.parallel import TPShard
from conveyor.executor.errors import ExecutorDeadError
from conveyor.executor.tp_messages import (
    ExecuteModel,
    InitializeWorker,
    KVCacheSized,
    ModelExecuted,
    SizeKVCache,
    WorkerCommand,
    WorkerInitialized,
    WorkerReady,
    WorkerReply,
)

logger = logging.getLogger(__name__)

# Loading, sizing and the warmup step (which may build native kernels) are allowed this
# long; a step gets ``distributed_timeout_s``.
START_TIMEOUT_S = 1800.0


def check_shardable(args: EngineArgs) -> None:
    """ValueError now, before any rank starts, if the model cannot be split this way."""
    model = args.resolve_model()
    shard = TPShard(0, args.tensor_parallel_size)
    shard.heads(model.num_heads, model.num_kv_heads)
    shard.intermediate(model.intermediate_size)


class TensorParallelExecutor:
    def __init__(self, args: EngineArgs) -> None:
        check_shardable(args)
        self.world_size = args.tensor_parallel_size
        self.timeout_s = args.distributed_timeout_s
        self.dead: str | None = None  # why the executor can run no more steps
        self.rank_info: list[WorkerInitialized] = []
        self._lora_ranks: dict[int, set[int]] = {}  # adapter id -> ranks that loaded it
        self.model_config: ModelConfig
        self.device: str

    # ---- what a placement implements ----------------------------------------------------
    def _call(self, cmd: WorkerCommand, timeout_s: float, what: str) -> list[WorkerReply]:
        """``cmd`` to every rank, their replies in rank order; ``self._fail`` otherwise."""
        raise NotImplementedError

    def _stop_ranks(self, graceful: bool) -> None:
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise ``ExecutorDeadError`` if a rank is gone (the engine loop asks while idle)."""
        raise NotImplementedError

    # ---- the executor seam ---------------------------------------------------------------
    def _ready(self, replies: list[WorkerReply]) -> None:
        first = replies[0]
        assert isinstance(first, WorkerReady)
        self.model_config, self.device = first.model, first.device

    def determine_num_kv_blocks(self, cache: CacheConfig, model: ModelConfig,
                                max_num_seqs: int) -> int:
        """The pool every rank holds: each rank's block is its KV heads only."""
        replies = self._call(SizeKVCache(cache, max_num_seqs), START_TIMEOUT_S, "sizing")
        return min(r.num_blocks for r in replies if isinstance(r, KVCacheSized))

    def initialize(self, config: EngineConfig) -> None:
        replies = self._call(InitializeWorker(config), START_TIMEOUT_S, "initialize")
        self.rank_info = [r for r in replies if isinstance(r, WorkerInitialized)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        replies = self._call(ExecuteModel(scheduler_output), self.timeout_s, "a step")
        first = replies[0]
        assert isinstance(first, ModelExecuted) and first.output is not None
        out = first.output
        out.lora_loaded, out.lora_failed = self._lora_report(replies)
        return out

    def _lora_report(self, replies: list[WorkerReply]) -> tuple[list[int], dict[int, str]]:
        """An adapter is loaded once every rank has reported its shard loaded; failed as
        soon as one rank failed it."""
        failed: dict[int, str] = {}
        for rank, reply in enumerate(replies):
            failed.update(reply.lora_failed)
            for lora_id in reply.lora_loaded:
                self._lora_ranks.setdefault(lora_id, set()).add(rank)
        loaded = [i for i, ranks in self._lora_ranks.items()
                  if len(ranks) == self.world_size and i not in failed]
        for lora_id in [*loaded, *failed]:
            self._lora_ranks.pop(lora_id, None)
        return loaded, failed

    def shutdown(self) -> None:
        self._stop_ranks(graceful=self.dead is None)
        self.dead = self.dead or "the executor was shut down"

    def _fail(self, reason: str) -> None:
        """Stop every rank (the others may sit in a collective the dead one never joins)
        and raise; later calls raise the same."""
        if self.dead is None:
            logger.error("tensor-parallel executor failed: %s; stopping every rank", reason)
            self.dead = reason
            self._stop_ranks(graceful=False)
        raise ExecutorDeadError(f"tensor-parallel executor failed: {self.dead}")

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise ExecutorDeadError(f"tensor-parallel executor failed: {self.dead}")
