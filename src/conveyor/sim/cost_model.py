"""The cost model protocol: how long one engine step takes, and how big the KV pool is.

The simulator asks ``step_time`` once per step with the batch's shape and advances
its virtual clock by the answer. Two implementations: ``ProfileCostModel`` (fitted
to step times measured on a real machine by ``conveyor profile``) and
``RooflineCostModel`` (compute and memory bounds from the model's shape and a
hardware spec). ``ReplayCostModel`` replays recorded step times, for tests.
"""

from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

from conveyor.config import ModelConfig
from conveyor.sim.batch import BatchShape


@runtime_checkable
class CostModel(Protocol):
    # When the pool is sized from ``kv_cache_memory`` by default, cap it at what
    # max_num_seqs full-length sequences can use (the engine does so on CPU).
    cap_kv_to_useful: bool

    def step_time(self, shape: BatchShape) -> float:
        """Seconds from one step's schedule() to the next step's, for this batch."""
        ...

    def kv_cache_memory(self, model: ModelConfig) -> int:
        """Bytes of KV pool the engine would take by default on the modelled machine."""
        ...

    def describe(self) -> str:
        """One line naming the model and its parameters, for reports."""
        ...


def make_cost_model(cost: str, model: ModelConfig, *, hardware: str = "h100",
                    tp: int = 1) -> CostModel:
    """``roofline`` (with ``hardware`` and ``tp``) or the path of a profile.json."""
    if cost == "roofline":
        from conveyor.sim.hardware import load_hardware
        from conveyor.sim.roofline import RooflineCostModel

        return RooflineCostModel(model, load_hardware(hardware), tp=tp)
    if cost.endswith(".json") or os.path.isfile(cost):
        from conveyor.sim.profile_model import ProfileCostModel

        if tp != 1:
            raise ValueError("--tp applies to the roofline cost model; a profile already "
                             "measured its machine as it was")
        profile = ProfileCostModel.load(cost)
        profile.check_model(model)
        return profile
    raise ValueError(f"cost model must be 'roofline' or the path of a profile.json from "
                     f"`conveyor profile`, got {cost!r}")


def load_step_cost(spec: str, model: ModelConfig):
    """The SLO token budget controller's step-cost model (``--slo-cost-model``): a
    ``conveyor profile`` JSON, ``roofline:HW`` (a preset or a hardware JSON, tp 1) or
    ``linear:BASE,PER_TOKEN,PER_SEQ`` in seconds. Torch-free (a profile needs numpy)."""
    kind, _, rest = spec.partition(":")
    if kind == "roofline" and rest:
        return make_cost_model("roofline", model, hardware=rest)
    if kind == "linear" and rest:
        from conveyor.bench.model_clock import StepCostModel

        return StepCostModel.parse(rest)
    if spec.endswith(".json") or os.path.isfile(spec):
        return make_cost_model(spec, model)
    raise ValueError(f"--slo-cost-model must be a `conveyor profile` JSON, roofline:HW or "
                     f"linear:BASE,PER_TOKEN,PER_SEQ, got {spec!r}")
