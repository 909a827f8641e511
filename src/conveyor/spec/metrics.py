"""Speculative decoding's counters (``stats()``, ``/metrics``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecMetrics:
    """Counters for ``stats()`` and ``/metrics`` (aggregates only: bounded in size)."""

    method: str
    num_speculative_tokens: int
    num_proposed_tokens: int = 0  # drafts the proposer returned
    num_draft_tokens: int = 0  # drafts verified by the target
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0  # (request, step) pairs that verified >= 1 draft
    num_decode_steps: int = 0  # (request, step) pairs of a decode, drafts or not
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    last_num_draft_tokens: int = 0  # in the last step, over every request
    num_guard_switch_offs: int = 0  # times the outcome guard found drafts losing
    num_guard_off_steps: int = 0  # steps with decodes in which the guard kept drafts off
    num_guard_trials: int = 0  # off trials the guard ran to compare drafted steps with
    num_probe_steps: int = 0  # steps the step-cost fit asked for drafts the rule refused
    num_explore_steps: int = 0  # steps where one request drafted one more than the rule

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        self.drafted_per_position = [0] * k
        self.accepted_per_position = [0] * k

    def as_dict(self) -> dict:
        verified = self.num_draft_tokens
        steps = self.num_verify_steps
        return {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "num_proposed_tokens": self.num_proposed_tokens,
            "num_draft_tokens": verified,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_verify_steps": steps,
            "num_decode_steps": self.num_decode_steps,
            "acceptance_rate": self.num_accepted_tokens / verified if verified else 0.0,
            # Tokens per verifying step, the bonus token included (vLLM's definition).
            "mean_acceptance_length": (1 + self.num_accepted_tokens / steps) if steps else 0.0,
            "num_guard_switch_offs": self.num_guard_switch_offs,
            "num_guard_off_steps": self.num_guard_off_steps,
            "num_guard_trials": self.num_guard_trials,
            "num_probe_steps": self.num_probe_steps,
            "num_explore_steps": self.num_explore_steps,
            "drafted_per_position": list(self.drafted_per_position),
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate_per_position": [
                a / d if d else 0.0
                for a, d in zip(self.accepted_per_position, self.drafted_per_position)],
        }
