"""The scheduling policies' knobs (core/policies reads them; each policy only its own)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from conveyor.config.names import PREDICTOR_NAMES

# sjf's default aging: off. With A > 0 no request is overtaken by one that arrived A
# seconds after it; on an overloaded queue (backlog of minutes) that turns sjf towards
# fcfs and loses its makespan (docs/scheduling.md), so the bound is the user's choice.
SJF_AGING_S = 0.0
# sjf's default overtake bound: a waiting request of work w is passed by at most
# SJF_OVERTAKE_FACTOR * w of admitted work, then goes first. Large, so that SJF's order
# (and the prefix-cache hits of serving same-length requests together) is kept until a
# request would otherwise starve (docs/scheduling.md has the measurements).
SJF_OVERTAKE_FACTOR = 1000.0


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs every policy may read; each policy reads only its own."""

    # sjf: a request is never overtaken by one that arrived this much later (0: no aging).
    sjf_aging_s: float = SJF_AGING_S
    # sjf: a waiting request of work w becomes overdue (goes first) once this many times w
    # of work was admitted after it joined the queue (0: no overtake bound).
    sjf_overtake_factor: float = SJF_OVERTAKE_FACTOR
    # sjf: how the expected output length is predicted (a name in ``PREDICTOR_NAMES``).
    sjf_predictor: str = "hint"
    # sjf: cost of a token still to prefill relative to an output token still to generate.
    sjf_prompt_weight: float = 1.0
    # fair: service counted as input_weight * prompt tokens + output_weight * output tokens.
    fair_input_weight: float = 1.0
    fair_output_weight: float = 2.0
    # fair: preempt to admit a waiting request when the running request's tenant has been
    # served more than this many weighted tokens beyond the waiting one's (None: never).
    fair_preempt_gap: float | None = 0.0
    # fair: a tenant joining the backlog may start this many weighted tokens below the
    # backlogged minimum (0: plain VTC lift), so a tenant that was idle goes first.
    fair_rejoin_credit: float = 2048.0
    # fair: (tenant, weight) pairs; a tenant of weight 2 gets twice the service of weight 1.
    tenant_weights: tuple[tuple[str, float], ...] = ()
    # edf: targets for requests that carry none.
    default_slo_ttft_s: float | None = None
    default_slo_tpot_s: float | None = None
    # lpm: how many of the oldest waiting requests are compared, and how many later
    # requests may overtake any one request.
    lpm_window: int = 64
    # slo: a waiting request that can no longer meet its TTFT target is served after the
    # on-time ones ("serve") or rejected early ("reject", HTTP 429 slo_unattainable).
    slo_late_action: str = "serve"
    # slo: among on-time requests whose latest start times fall in one window of
    # slo_tie_quantum_s, the least served tenant (VTC counter) goes first ("fair"), or the
    # earliest latest start ("slack").
    slo_tie_break: str = "slack"
    slo_tie_quantum_s: float = 0.05

    def __post_init__(self) -> None:
        _check(self.sjf_aging_s >= 0 and math.isfinite(self.sjf_aging_s), "sjf_aging_s",
               f"must be a finite number >= 0, got {self.sjf_aging_s}")
        _check(self.sjf_overtake_factor >= 0 and math.isfinite(self.sjf_overtake_factor),
               "sjf_overtake_factor",
               f"must be a finite number >= 0, got {self.sjf_overtake_factor}")
        _check(self.sjf_predictor in PREDICTOR_NAMES, "sjf_predictor",
               f"must be one of {', '.join(sorted(PREDICTOR_NAMES))}, "
               f"got {self.sjf_predictor!r}")
        _check(self.sjf_prompt_weight >= 0 and math.isfinite(self.sjf_prompt_weight),
               "sjf_prompt_weight", f"must be a finite number >= 0, got {self.sjf_prompt_weight}")
        _check(self.fair_input_weight >= 0, "fair_input_weight",
               f"must be >= 0, got {self.fair_input_weight}")
        _check(self.fair_output_weight >= 0, "fair_output_weight",
               f"must be >= 0, got {self.fair_output_weight}")
        _check(self.fair_input_weight + self.fair_output_weight > 0, "fair_input_weight",
               "and fair_output_weight may not both be 0")
        if self.fair_preempt_gap is not None:
            _check(self.fair_preempt_gap >= 0 and math.isfinite(self.fair_preempt_gap),
                   "fair_preempt_gap", f"must be a finite number >= 0 or None, got "
                   f"{self.fair_preempt_gap}")
        _check(self.fair_rejoin_credit >= 0 and math.isfinite(self.fair_rejoin_credit),
               "fair_rejoin_credit", f"must be a finite number >= 0, got "
               f"{self.fair_rejoin_credit}")
        for tenant, weight in self.tenant_weights:
            _check(weight > 0 and math.isfinite(weight), "tenant_weights",
                   f"must be finite and > 0, got {weight} for tenant {tenant!r}")
        for name in ("default_slo_ttft_s", "default_slo_tpot_s"):
            value = getattr(self, name)
            if value is not None:
                _check(value > 0, name, f"must be > 0, got {value}")
        _check(isinstance(self.lpm_window, int) and self.lpm_window >= 1, "lpm_window",
               f"must be an integer >= 1, got {self.lpm_window}")
        _check(self.slo_late_action in ("serve", "reject"), "slo_late_action",
               f"must be 'serve' or 'reject', got {self.slo_late_action!r}")
        _check(self.slo_tie_break in ("slack", "fair"), "slo_tie_break",
               f"must be 'slack' or 'fair', got {self.slo_tie_break!r}")
        _check(self.slo_tie_quantum_s > 0 and math.isfinite(self.slo_tie_quantum_s),
               "slo_tie_quantum_s", f"must be a finite number > 0, got "
               f"{self.slo_tie_quantum_s}")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")
