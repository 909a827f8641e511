"""An engine core over a real executor (the model in this process, or tensor-parallel
ranks): what ``LLMEngine`` and the engine-core process build. Loads torch: import it
where the model runs, not in the API server."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from conveyor import envs
from conveyor.config import EngineArgs, resolve_engine_config
from conveyor.engine.core import EngineCore
from conveyor.executor.factory import make_executor


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
        from conveyor.costs.factory import load_step_cost

        step_cost = load_step_cost(args.slo_cost_model, config.model)
    core = EngineCore(config, executor, clock, step_cost=step_cost)
    freeze_startup_heap()
    return core


def freeze_startup_heap() -> None:
    """What starting allocated (modules, the model, the engine) lives as long as the
    process: moved out of the cyclic GC's generations (``gc.freeze``, as vLLM's engine
    does after start-up), so that no collection walks it again. Whatever allocates many
    objects later (the suffix proposer's trees) would otherwise set off full collections
    over that whole heap. ``CONVEYOR_GC_FREEZE=0`` leaves the collector alone."""
    if not envs.switched_on(envs.GC_FREEZE):
        return
    gc.collect(1)  # the young garbage of start-up (older cycles are rare and stay)
    gc.freeze()
