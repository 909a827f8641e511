"""Trace-driven simulation: conveyor's own scheduler and KV manager on a virtual clock.

Never imports torch or the model runner (``profiler`` and ``profile_cli.run`` do,
to measure a real machine; nothing here imports them).

    from conveyor.sim import Simulator, make_cost_model, resolve_sim_model
    model = resolve_sim_model(engine_args)
    sim = Simulator(engine_args, make_cost_model("roofline", model, hardware="h100"),
                    replicas=4, router="least_loaded")
    result = sim.run(workload_requests)   # result.finished: request id -> RequestMetrics
"""

from conveyor.sim.batch import BatchShape, batch_shape
from conveyor.sim.capacity import SLO, CapacityResult, find_max_rate, find_min_replicas
from conveyor.sim.cost_model import CostModel, make_cost_model
from conveyor.sim.hardware import HARDWARE_PRESETS, HardwareSpec, load_hardware
from conveyor.sim.model import resolve_sim_model
from conveyor.sim.profile_model import ProfileCostModel
from conveyor.sim.recorder import ReplayCostModel, StepRecord, StepRecorder
from conveyor.sim.roofline import ModelShape, RooflineCostModel
from conveyor.sim.router import ROUTERS, make_router
from conveyor.sim.simulator import SimResult, Simulator, simulate

__all__ = [
    "HARDWARE_PRESETS",
    "ROUTERS",
    "SLO",
    "BatchShape",
    "CapacityResult",
    "CostModel",
    "HardwareSpec",
    "ModelShape",
    "ProfileCostModel",
    "ReplayCostModel",
    "RooflineCostModel",
    "SimResult",
    "Simulator",
    "StepRecord",
    "StepRecorder",
    "batch_shape",
    "find_max_rate",
    "find_min_replicas",
    "load_hardware",
    "make_cost_model",
    "make_router",
    "resolve_sim_model",
    "simulate",
]
