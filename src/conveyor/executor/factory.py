"""Which executor the engine args ask for (the one place that knows them all)."""

from __future__ import annotations

from conveyor.config import EngineArgs
from conveyor.executor.local import LocalExecutor
from conveyor.executor.multiproc import MultiprocExecutor
from conveyor.executor.ray_executor import RayExecutor


def make_executor(args: EngineArgs) -> LocalExecutor | MultiprocExecutor | RayExecutor:
    """The executor the args ask for: in this process, or tensor-parallel ranks in
    processes (``mp``) or Ray actors (``ray``); all serve the same four calls."""
    if args.distributed_executor_backend == "ray":
        return RayExecutor(args)
    if args.tensor_parallel_size > 1:
        return MultiprocExecutor(args)
    return LocalExecutor(args)
