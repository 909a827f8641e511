"""Cost models built from command-line strings (``--cost``, ``--slo-cost-model``).

``ProfileCostModel`` (fitted to step times measured on a real machine by ``conveyor
profile``), ``RooflineCostModel`` (compute and memory bounds from the model's shape
and a hardware spec) and ``LinearStepCost`` (three constants).
"""

from __future__ import annotations

import os

from conveyor.config import ModelConfig
from conveyor.costs.protocol import MachineCostModel, StepCostModel


def make_cost_model(cost: str, model: ModelConfig, *, hardware: str = "h100",
                    tp: int = 1) -> MachineCostModel:
    """``roofline`` (with ``hardware`` and ``tp``) or the path of a profile.json."""
    if cost == "roofline":
        from conveyor.costs.hardware import load_hardware
        from conveyor.costs.roofline import RooflineCostModel

        return RooflineCostModel(model, load_hardware(hardware), tp=tp)
    if cost.endswith(".json") or os.path.isfile(cost):
        from conveyor.costs.profile import ProfileCostModel

        if tp != 1:
            raise ValueError("--tp applies to the roofline cost model; a profile already "
                             "measured its machine as it was")
        profile = ProfileCostModel.load(cost)
        profile.check_model(model)
        return profile
    raise ValueError(f"cost model must be 'roofline' or the path of a profile.json from "
                     f"`conveyor profile`, got {cost!r}")


def load_step_cost(spec: str, model: ModelConfig) -> StepCostModel:
    """The SLO token budget controller's step-cost model (``--slo-cost-model``): a
    ``conveyor profile`` JSON, ``roofline:HW`` (a preset or a hardware JSON, tp 1) or
    ``linear:BASE,PER_TOKEN,PER_SEQ`` in seconds. Torch-free (a profile needs numpy)."""
    kind, _, rest = spec.partition(":")
    if kind == "roofline" and rest:
        return make_cost_model("roofline", model, hardware=rest)
    if kind == "linear" and rest:
        from conveyor.costs.linear import LinearStepCost

        return LinearStepCost.parse(rest)
    if spec.endswith(".json") or os.path.isfile(spec):
        return make_cost_model(spec, model)
    raise ValueError(f"--slo-cost-model must be a `conveyor profile` JSON, roofline:HW or "
                     f"linear:BASE,PER_TOKEN,PER_SEQ, got {spec!r}")
