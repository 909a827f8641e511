"""Cheap wall-clock accounting of where a step's time goes (a few perf_counter calls)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PhaseTimings:
    seconds: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    def add(self, phase: str, elapsed: float) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + elapsed
        self.counts[phase] = self.counts.get(phase, 0) + 1

    def reset(self) -> None:
        self.seconds.clear()
        self.counts.clear()

    def mean_ms(self) -> dict[str, float]:
        return {k: 1e3 * v / self.counts[k] for k, v in self.seconds.items()}
