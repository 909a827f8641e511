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

Any of the simulator's cost models (``conveyor.sim``: a ``conveyor profile`` fit, the
roofline) works in place of ``StepCostModel``: the clock asks ``step_time`` of the
step's ``BatchShape``, as the simulator does.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.sim.batch import BatchShape, batch_shape


@dataclass(frozen=True)
class StepCostModel:
    base_s: float
    per_token_s: float
    per_seq_s: float

    def __post_init__(self) -> None:
        for name in ("base_s", "per_token_s", "per_seq_s"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"step cost {name} must be >= 0, got {value}")
        if self.base_s + self.per_token_s + self.per_seq_s <= 0:
            raise ValueError("a step cost model must charge something per step")

    def cost(self, num_seqs: int, num_tokens: int) -> float:
        return self.base_s + self.per_token_s * num_tokens + self.per_seq_s * num_seqs

    def step_time(self, shape: BatchShape) -> float:
        """The simulator's cost model interface."""
        return self.cost(shape.num_prefills + shape.num_decodes, shape.num_tokens)

    @classmethod
    def fit(cls, trace: list[tuple[int, int, float]]) -> StepCostModel:
        """Least squares on ``(requests, tokens, seconds)`` per step (a run's
        ``step_trace``); a negative coefficient is dropped and the rest refitted."""
        import numpy as np

        if len(trace) < 3:
            raise ValueError(f"need at least 3 steps to fit a step cost model, got "
                             f"{len(trace)}")
        data = np.asarray(trace, dtype=float)
        columns = {"base_s": np.ones(len(data)), "per_token_s": data[:, 1],
                   "per_seq_s": data[:, 0]}
        seconds = data[:, 2]
        active = list(columns)
        while True:
            a = np.stack([columns[n] for n in active], axis=1)
            coef, *_ = np.linalg.lstsq(a, seconds, rcond=None)
            negative = [n for n, c in zip(active, coef) if c < 0]
            if not negative:
                break
            active.remove(negative[0])
        fitted = dict.fromkeys(columns, 0.0)
        fitted.update({n: float(c) for n, c in zip(active, coef)})
        return cls(**fitted)

    @classmethod
    def parse(cls, text: str) -> StepCostModel:
        """``BASE,PER_TOKEN,PER_SEQ`` in seconds, as ``describe`` writes it."""
        try:
            base, per_token, per_seq = (float(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"bad step cost model {text!r}: expected BASE,PER_TOKEN,PER_SEQ "
                             "in seconds, e.g. 0.004,1e-05,0.0002") from None
        return cls(base, per_token, per_seq)

    def describe(self) -> str:
        return f"{self.base_s:.6g},{self.per_token_s:.6g},{self.per_seq_s:.6g}"


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
    by the step's modelled cost (``model.step_time(shape)``: a ``StepCostModel`` or a
    simulator cost model), so tokens are stamped when the modelled step ends."""

    def __init__(self, inner, clock: ModelClock, model) -> None:
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
