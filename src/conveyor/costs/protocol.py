"""The step-cost protocol, and its extension for a whole modelled machine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from conveyor.costs.shape import BatchShape

if TYPE_CHECKING:  # (conveyor.config imports the core, which imports this module)
    from conveyor.config import ModelConfig


class StepCostModel(Protocol):
    """Seconds one step of a given shape takes: all the budget controller, the bench's
    model clock and speculative decoding's online fit ask of a cost model."""

    def step_time(self, shape: BatchShape) -> float:
        """Seconds from one step's schedule() to the next step's, for this batch."""
        ...


@runtime_checkable
class MachineCostModel(StepCostModel, Protocol):
    """A step-cost model of a whole machine, which also sizes its KV pool: what the
    simulator and the cost-model executor run on."""

    # When the pool is sized from ``kv_cache_memory`` by default, cap it at what
    # max_num_seqs full-length sequences can use (the engine does so on CPU).
    cap_kv_to_useful: bool

    def kv_cache_memory(self, model: ModelConfig) -> int:
        """Bytes of KV pool the engine would take by default on the modelled machine."""
        ...

    def describe(self) -> str:
        """One line naming the model and its parameters, for reports."""
        ...
