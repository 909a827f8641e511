"""The scheduler's aggregate counters (``Scheduler.stats``): what ``EngineCore.stats()``
reports of scheduling."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    # of which made to admit a waiting request (the rest: a running request needed a block)
    num_admission_preemptions: int = 0
    num_rejected: int = 0  # queue full (counted by the engine) or waited too long
    num_wait_rejected: int = 0  # rejected by max_queue_wait_s
    num_slo_rejected: int = 0  # rejected early by the policy: TTFT target out of reach
    num_overdue: int = 0  # promoted ahead of the policy's order by max_queue_wait_s
    peak_running: int = 0
    peak_waiting: int = 0
    total_scheduled_tokens: int = 0
    # Aggregates only: nothing here grows with the number of steps (a server runs for days).
    num_batched_rows: int = 0  # requests summed over steps (mean batch = this / num_steps)
    # Prompt positions computed here (a prefix hit or remote KV is not; a recomputed
    # preempted prompt is again).
    num_prompt_tokens_computed: int = 0
    last_step_batch_size: int = 0
    # Prefills sharing steps (core/prefill_split.py): partial prefills summed over steps
    # (mean per step = this / num_steps), the most in one step, times a started prefill
    # was paused (got no tokens while its prompt was unfinished) and the time it spent so.
    num_partial_prefills: int = 0
    peak_partial_prefills: int = 0
    num_paused_prefills: int = 0
    prefill_paused_s: float = 0.0
