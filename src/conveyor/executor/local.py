"""The in-process executor: conveyor's model runner on this process's device (torch)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from conveyor.config import (
    CacheConfig,
    EngineArgs,
    EngineConfig,
    ModelConfig,
    resolve_engine_config,
)
from conveyor.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from conveyor.engine.core import EngineCore
from conveyor.model.dtypes import resolve_compute_dtype
from conveyor.runner.model_runner import ModelRunner, num_blocks_for


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class LocalExecutor:
    """Loads the model at construction; the KV pool is sized after the weights are in
    (``determine_num_kv_blocks``: from what memory is left) and allocated by ``initialize``,
    which also runs the start-up warmup step."""

    def __init__(self, args: EngineArgs) -> None:
        self.device = resolve_device(args.device)
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        model = args.resolve_model()
        self.model_config: ModelConfig = dataclasses.replace(
            model, compute_dtype=resolve_compute_dtype(args.compute_dtype, model.dtype,
                                                       self.device))
        self.runner = ModelRunner(self.model_config, args.cache_config(), self.device,
                                  args.attention_backend, args.linear_backend,
                                  linear_rows=(args.max_num_seqs,
                                               args.max_num_batched_tokens),
                                  speculative=args.speculative)
        self.warmup = args.warmup

    def determine_num_kv_blocks(self, cache: CacheConfig, model: ModelConfig,
                                max_num_seqs: int) -> int:
        blocks = num_blocks_for(cache, model, self.device, max_num_seqs)
        draft = getattr(self.runner.proposer, "kv_bytes_per_token", 0)
        if draft and cache.num_kv_blocks is None:
            # A block also holds the draft model's layers: the same memory holds fewer.
            target = model.kv_bytes_per_token
            blocks = max(1, blocks * target // (target + draft))
        return blocks

    def initialize(self, config: EngineConfig) -> None:
        self.runner.allocate_kv_cache(config.cache.num_kv_blocks)
        if self.warmup:  # before any request: its K/V lands in blocks nobody owns yet
            self.runner.warmup(config.scheduler.max_num_batched_tokens,
                               config.model.max_model_len - 1)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(scheduler_output)

    def shutdown(self) -> None:
        pass


def make_executor(args: EngineArgs):
    """The executor the args ask for: in this process, or tensor-parallel ranks in
    processes (``mp``) or Ray actors (``ray``); all serve the same four calls."""
    if args.distributed_executor_backend == "ray":
        from conveyor.executor.ray_executor import RayExecutor

        return RayExecutor(args)
    if args.tensor_parallel_size > 1:
        from conveyor.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(args)
    return LocalExecutor(args)


def build_local_core(args: EngineArgs, clock: Callable[[], float] = time.monotonic
                     ) -> EngineCore:
    """An engine core over the executor ``make_executor`` picks: load, size the pool,
    resolve, allocate."""
    executor = make_executor(args)
    num_blocks = executor.determine_num_kv_blocks(args.cache_config(), executor.model_config,
                                                  args.max_num_seqs)
    config = resolve_engine_config(args, executor.model_config, num_blocks,
                                   str(executor.device))
    executor.initialize(config)
    step_cost = None
    if args.slo_cost_model:  # the SLO token budget controller's cost model (torch-free)
        from conveyor.sim.cost_model import load_step_cost

        step_cost = load_step_cost(args.slo_cost_model, config.model)
    return EngineCore(config, executor, clock, step_cost=step_cost)
