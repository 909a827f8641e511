"""What the scheduler is told: batch limits, policy, admission control, token budget."""

from __future__ import annotations

from dataclasses import dataclass, field

from conveyor.config.names import POLICY_NAMES
from conveyor.config.policy import PolicyConfig
from conveyor.config.speculative import SpeculativeConfig

# How the per-step token budget is chosen (core/budget.py reads the same modes).
TOKEN_BUDGET_MODES = ("auto", "fixed", "slo")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    batching: str = "continuous"  # continuous | static
    scheduling_policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    max_queue_len: int | None = None  # admission control: reject beyond this many waiting
    max_queue_wait_s: float | None = None
    queue_wait_action: str = "admit"  # admit | reject
    max_preemptions_per_request: int | None = None
    # The per-step token budget: "fixed" (max_num_batched_tokens), "slo" (chosen each step
    # from TPOT targets by a step-cost model, max_num_batched_tokens the ceiling), "auto"
    # (slo for the slo policy). See core/budget.py.
    token_budget: str = "auto"
    # The controller multiplies the cost model's predictions by this (1.1: steps run 10%
    # slower than it says).
    slo_cost_scale: float = 1.0
    # Prefills sharing a step (core/prefill_split.py). A prefill is long while more than
    # long_prefill_token_threshold prompt tokens are left (0: max_num_batched_tokens, i.e.
    # it cannot end in one step). At most max_num_partial_prefills prefills that do not end
    # this step advance per step, of them at most max_long_partial_prefills long ones (the
    # rest pause, keeping their blocks). The first long prefill in policy order keeps at
    # least long_prefill_min_share of the prefill budget (what the decodes leave) whenever
    # it wants that much: its TTFT in steps is at most 1 / share times its steps alone.
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    long_prefill_min_share: float = 0.5
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    # Speculative decoding (None: off): the scheduler decides the draft lengths.
    speculative: SpeculativeConfig | None = None
    # Schedule step n+1 while step n runs (engine/async_steps.py).
    async_scheduling: bool = False
    # Multi-LoRA: adapters in one step (0: LoRA off, no constraint). core/lora_gate.py.
    max_loras: int = 0
    # Adapters the executor keeps loaded (core/lora_loads.py; 0: max_loras).
    max_cpu_loras: int = 0
    # The gate's drain rule (no adapter starves); off only to measure what it does
    # (benchmarks/sim/lora_burst.py).
    lora_drain: bool = True

    @property
    def long_prefill_threshold(self) -> int:
        """Prompt tokens left above which a prefill counts as long."""
        return self.long_prefill_token_threshold or self.max_num_batched_tokens

    def __post_init__(self) -> None:
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {self.batching!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.queue_wait_action not in ("admit", "reject"):
            raise ValueError(
                f"queue_wait_action must be 'admit' or 'reject', got {self.queue_wait_action!r}")
        if self.scheduling_policy not in POLICY_NAMES:
            raise ValueError(f"unknown scheduling policy {self.scheduling_policy!r}; valid "
                             f"policies: {', '.join(sorted(POLICY_NAMES))}")
        if self.max_queue_len is not None and self.max_queue_len < 0:
            raise ValueError(f"max_queue_len must be >= 0, got {self.max_queue_len}")
        if self.max_queue_wait_s is not None and not self.max_queue_wait_s >= 0:
            raise ValueError(f"max_queue_wait_s must be >= 0, got {self.max_queue_wait_s}")
        if self.token_budget not in TOKEN_BUDGET_MODES:
            raise ValueError(f"token_budget must be one of {', '.join(TOKEN_BUDGET_MODES)}, "
                             f"got {self.token_budget!r}")
        if not (self.slo_cost_scale > 0 and self.slo_cost_scale < float("inf")):
            raise ValueError(f"slo_cost_scale must be a finite number > 0, "
                             f"got {self.slo_cost_scale}")
        if self.max_num_partial_prefills < 1:
            raise ValueError(f"max_num_partial_prefills must be >= 1, "
                             f"got {self.max_num_partial_prefills}")
        if not 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills:
            raise ValueError(f"max_long_partial_prefills must be >= 1 and <= "
                             f"max_num_partial_prefills ({self.max_num_partial_prefills}), "
                             f"got {self.max_long_partial_prefills}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, "
                             f"got {self.long_prefill_token_threshold}")
        if not 0 < self.long_prefill_min_share <= 1:
            raise ValueError(f"long_prefill_min_share must be in (0, 1], "
                             f"got {self.long_prefill_min_share}")
        if self.max_preemptions_per_request is not None \
                and self.max_preemptions_per_request < 0:
            raise ValueError(f"max_preemptions_per_request must be >= 0, "
                             f"got {self.max_preemptions_per_request}")

