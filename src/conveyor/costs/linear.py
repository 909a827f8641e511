"""A linear step-cost model: ``base_s + per_token_s x tokens + per_seq_s x requests``.

Fitted (least squares) to the step trace of a wall-clock run, or given as three
constants (``BASE,PER_TOKEN,PER_SEQ``, as ``describe`` writes them), so that another
machine replays the very same timeline (the bench's model clock) or the SLO token
budget prices steps without a profile (``--slo-cost-model linear:...``).
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.costs.shape import BatchShape


@dataclass(frozen=True)
class LinearStepCost:
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
        return self.cost(shape.num_prefills + shape.num_decodes, shape.num_tokens)

    @classmethod
    def fit(cls, trace: list[tuple[int, int, float]]) -> LinearStepCost:
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
    def parse(cls, text: str) -> LinearStepCost:
        """``BASE,PER_TOKEN,PER_SEQ`` in seconds, as ``describe`` writes it."""
        try:
            base, per_token, per_seq = (float(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"bad step cost model {text!r}: expected BASE,PER_TOKEN,PER_SEQ "
                             "in seconds, e.g. 0.004,1e-05,0.0002") from None
        return cls(base, per_token, per_seq)

    def describe(self) -> str:
        return f"{self.base_s:.6g},{self.per_token_s:.6g},{self.per_seq_s:.6g}"
