"""A modelled clock: replay a workload through the real engine in virtual time.

On a shared machine, two runs of the same workload can differ by half in wall time
(and, at a load above capacity, their queueing delays by more): whatever the
neighbours do lands in every figure. The scheduler reads time only through the
engine's clock, so the bench can hand it a virtual one instead:

    time advances only by the modelled cost of each step the engine runs,
        cost = base_s + per_token_s * tokens in the step + per_seq_s * requests in it,
    and jumps to the next arrival when the engine is idle.

The engine still computes every token (outputs are the real ones), but every
timestamp (arrival, scheduling, each token) is virtual, so a run is a deterministic
function of the workload, the engine options and the three constants: policies
compared on one cost model differ by what they decided, nothing else. The constants
are fitted (least squares) to the step trace of a wall-clock run on the machine at
hand, or given, so that another machine replays the very same timeline.

Any ``StepCostModel`` (``conveyor.costs``: ``LinearStepCost``, a ``conveyor profile``
fit, the roofline) drives it: the clock asks ``step_time`` of the step's
``BatchShape``, as the simulator does.
"""

from __future__ import annotations

from conveyor.core.batch_shape import batch_shape
from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.costs.protocol import StepCostModel


class ModelClock:
    """Virtual seconds: moved by ``add`` (a step's cost) and ``advance_to`` (idling)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def add(self, seconds: float) -> None:
        self.now += seconds

    def advance_to(self, t: float) -> None:
        """Idle until ``t`` (never backwards)."""
        self.now = max(self.now, t)


class ModelClockExecutor:
    """An executor around the engine's own: after each ``execute_model`` the clock moves
    by the step's modelled cost (``model.step_time(shape)``), so tokens are stamped
    when the modelled step ends."""

    def __init__(self, inner, clock: ModelClock, model: StepCostModel) -> None:
        self.inner = inner
        self.clock = clock
        self.model = model

    def execute_model(self, out: SchedulerOutput):
        result = self.inner.execute_model(out)
        if out.num_scheduled_tokens:
            self.clock.add(self.model.step_time(batch_shape(out)))
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()
