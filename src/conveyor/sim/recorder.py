"""Recording a scheduler's steps, and replaying recorded step times as a cost model.

``StepRecorder`` wraps a Scheduler's ``schedule`` and ``update`` (of a real engine
or of the simulator) and logs each step that ran: its start and end on the engine's
clock, its batch (request id -> tokens computed) and its shape. ``conveyor profile``
uses it to pair measured step times with batch shapes; tests use it to replay a real
run's step times in the simulator and compare the batches step by step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from conveyor.config import ModelConfig
from conveyor.core.batch_shape import batch_shape
from conveyor.core.scheduler import Scheduler
from conveyor.core.scheduler_output import ModelRunnerOutput, RequestUpdate, SchedulerOutput
from conveyor.costs.shape import BatchShape


@dataclass
class StepRecord:
    start: float  # the `now` schedule() was called with
    end: float  # the `now` update() was called with
    batch: dict[str, int]  # request id -> tokens computed this step
    shape: BatchShape

    @property
    def duration(self) -> float:
        return self.end - self.start


class StepRecorder:
    """Logs every non-empty step of ``scheduler``; ``before_schedule(now)`` runs first.

    ``before_schedule`` lets a driver add the requests that have arrived by ``now``
    at the very moment the scheduler looks, which is how the simulator sees arrivals.
    """

    def __init__(self, scheduler: Scheduler,
                 before_schedule: Callable[[float], None] | None = None) -> None:
        self.scheduler = scheduler
        self.before_schedule = before_schedule
        self.records: list[StepRecord] = []
        self._schedule = scheduler.schedule
        self._update = scheduler.update
        self._started: tuple[float, SchedulerOutput] | None = None
        scheduler.schedule = self._on_schedule  # type: ignore[method-assign]
        scheduler.update = self._on_update  # type: ignore[method-assign]

    def _on_schedule(self, now: float) -> SchedulerOutput:
        if self.before_schedule is not None:
            self.before_schedule(now)
        out = self._schedule(now)
        self._started = (now, out)
        return out

    def _on_update(self, out: SchedulerOutput, run: ModelRunnerOutput,
                   now: float) -> list[RequestUpdate]:
        if self._started is not None and self._started[1] is out and not out.is_empty:
            self.records.append(StepRecord(self._started[0], now,
                                           dict(out.num_scheduled_tokens), batch_shape(out)))
        self._started = None
        return self._update(out, run, now)

    @property
    def in_progress(self) -> SchedulerOutput | None:
        """The step scheduled and not yet updated (what a model clock prices)."""
        return None if self._started is None else self._started[1]

    def detach(self) -> None:
        self.scheduler.schedule = self._schedule  # type: ignore[method-assign]
        self.scheduler.update = self._update  # type: ignore[method-assign]


class ReplayCostModel:
    """Returns recorded step durations in order, whatever the batch (for replay tests)."""

    cap_kv_to_useful = False
    # Each call consumes a recorded step: it cannot answer the budget controller's "what
    # if" questions (the simulator then gives the controller no model of its own).
    predictive = False

    def __init__(self, durations: list[float]) -> None:
        self.durations = list(durations)
        self._next = 0

    def step_time(self, shape: BatchShape) -> float:
        if self._next >= len(self.durations):
            raise RuntimeError(f"the simulation ran more steps than the {len(self.durations)} "
                               "recorded ones: its batches diverged from the recording")
        self._next += 1
        return self.durations[self._next - 1]

    def kv_cache_memory(self, model: ModelConfig) -> int:
        raise ValueError("replaying recorded step times: give the KV pool size "
                         "(EngineArgs.num_kv_blocks) of the recorded run")

    def describe(self) -> str:
        return f"replay of {len(self.durations)} recorded steps"
