"""Trace-driven simulation: conveyor's own scheduler and KV manager on a virtual clock.

Never imports torch or the model runner (``profiler`` and ``profile_cli.run`` do,
to measure a real machine; nothing here imports them). The cost models it runs on
live in ``conveyor.costs``.

    from conveyor.costs.factory import make_cost_model
    from conveyor.sim import Simulator, resolve_sim_model
    model = resolve_sim_model(engine_args)
    sim = Simulator(engine_args, make_cost_model("roofline", model, hardware="h100"),
                    replicas=4, router="least_loaded")
    result = sim.run(workload_requests)   # result.finished: request id -> RequestMetrics
"""

from conveyor.sim.capacity import SLO, CapacityResult, find_max_rate, find_min_replicas
from conveyor.sim.model import resolve_sim_model
from conveyor.sim.recorder import ReplayCostModel, StepRecord, StepRecorder
from conveyor.sim.router import ROUTERS, make_router
from conveyor.sim.simulator import SimResult, Simulator, simulate

__all__ = [
    "ROUTERS",
    "SLO",
    "CapacityResult",
    "ReplayCostModel",
    "SimResult",
    "Simulator",
    "StepRecord",
    "StepRecorder",
    "find_max_rate",
    "find_min_replicas",
    "make_router",
    "resolve_sim_model",
    "simulate",
]
