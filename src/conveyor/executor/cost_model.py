"""An executor without a model: each step "samples" one fixed token for every request
that reaches its end, and takes the time a cost model says (no torch).

The simulator runs the core's two halves at two virtual times and asks ``last_step_s``;
the bench's model clock (``clock`` given) moves the clock by the step's cost inside
``execute_model``, so the core's update reads the step's end time.
"""

from __future__ import annotations

import random
from typing import Protocol

from conveyor.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SpeculativeConfig,
    kv_blocks_for,
)
from conveyor.core.batch_shape import batch_shape
from conveyor.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from conveyor.costs.protocol import MachineCostModel
from conveyor.executor.lora_slots import AdapterSlots


class AdvancingClock(Protocol):
    def add(self, seconds: float) -> None: ...


def fake_token_for(model: ModelConfig) -> int:
    """A token in the vocabulary that never ends a sequence: requests run to max_tokens."""
    eos = set(model.eos_token_ids)
    return next(t for t in range(model.vocab_size) if t not in eos)


class CostModelExecutor:
    """With speculative decoding, a request verifying ``k`` drafts accepts each with
    ``speculative_config.acceptance_rate`` given the ones before it were (a float, or one
    rate per position: the accepted-length distribution measured on real traffic), drawn
    from a seeded generator; its proposals are always there."""

    def __init__(self, cost: MachineCostModel, model: ModelConfig,
                 clock: AdvancingClock | None = None,
                 speculative: SpeculativeConfig | None = None,
                 lora_slots: AdapterSlots | None = None) -> None:
        """``lora_slots``: price adapter swaps into ``max_loras`` slots (None: free)."""
        self.cost = cost
        self.lora_slots = lora_slots
        self.clock = clock
        self._sampled = [fake_token_for(model)]  # shared: the scheduler only reads it
        self.last_step_s = 0.0
        self.speculative = speculative
        self._rates: list[float] = []
        if speculative is not None:
            rate = speculative.acceptance_rate
            if rate is None:
                raise ValueError("simulating speculative decoding needs "
                                 "speculative_config.acceptance_rate (a rate, or one per "
                                 "position): the simulator has no model to verify with")
            k = speculative.num_speculative_tokens
            self._rates = list(rate) if isinstance(rate, list | tuple) else [rate] * k
            self._rates += [self._rates[-1]] * (k - len(self._rates))
            self._rng = random.Random(speculative.seed)

    def determine_num_kv_blocks(self, cache: CacheConfig, model: ModelConfig,
                                max_num_seqs: int) -> int:
        """What the cost model's machine would hold (its ``kv_cache_memory``)."""
        return kv_blocks_for(cache, model, max_num_seqs,
                             default_memory=lambda: self.cost.kv_cache_memory(model),
                             cap_to_useful=self.cost.cap_kv_to_useful)

    def initialize(self, config: EngineConfig) -> None:
        pass

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        out = scheduler_output
        if out.is_empty:
            self.last_step_s = 0.0
            return ModelRunnerOutput(lora_loaded=out.lora_load_ids)  # (no adapters here)
        duration = self.cost.step_time(batch_shape(out))
        if not duration > 0.0:
            raise ValueError(f"cost model {self.cost.describe()} returned a step time of "
                             f"{duration!r} s; it must be positive")
        if self.lora_slots is not None:
            duration += self.lora_slots.step_cost(out)
        self.last_step_s = duration
        if self.clock is not None:
            self.clock.add(duration)
        sampled = self._sampled
        result = ModelRunnerOutput({rid: sampled for rid in out.sampling_req_ids},
                                   lora_loaded=out.lora_load_ids)
        if self.speculative is not None:
            self._speculate(out, result)
        return result

    def _speculate(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        token, rand, rates = self._sampled[0], self._rng.random, self._rates
        for rid, drafts in out.scheduled_spec_tokens.items():
            a = 0
            while a < len(drafts) and rand() < rates[a]:
                a += 1
            result.sampled_token_ids[rid] = [token] * (a + 1)
        for rid, k in out.num_spec_wanted.items():
            result.spec_token_ids[rid] = [token] * k

    def shutdown(self) -> None:
        pass
