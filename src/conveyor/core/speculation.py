"""What the scheduler asks of speculative decoding: two calls a step.

    decision = speculation.plan(DraftStep(...))      # schedule(): drafts within the budget
    speculation.observe(StepOutcome(...))            # update(): what the step did

The scheduler keeps what is its own (the token budget, KV slots, rolling back the
computed tokens of rejected drafts, giving lookahead blocks back) and hands over the
facts; everything about drafts (how many each request verifies and proposes, the
step-cost fit, acceptance tracking, the outcome guard) lives in ``conveyor.spec``, which
implements this protocol. Defined here so that the core imports nothing above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from conveyor.core.budget import BudgetController
from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from conveyor.request import Request


@dataclass
class DraftStep:
    """The step being formed, once every running and admitted request has its tokens."""

    now: float
    step_index: int  # the scheduler's step count (a proposal is stamped with it)
    decodes: list[Request]  # requests computing their one next token: draft candidates
    scheduled: dict[str, int]  # request id -> tokens this step; drafts are added to it
    budget: int  # tokens the step has left
    requests: dict[str, Request]
    kv: KVCacheManager  # draft slots and lookahead come from the same pool, never by preempting
    budget_ctrl: BudgetController | None  # the SLO token budget (None: fixed)
    max_model_len: int
    # Requests that left since speculation last heard (finished, aborted, rejected).
    departed: list[Request] = field(default_factory=list)


@dataclass
class DraftDecision:
    """What goes into the step's ``SchedulerOutput``."""

    spec_tokens: dict[str, list[int]] = field(default_factory=dict)  # drafts verified
    wanted: dict[str, int] = field(default_factory=dict)  # drafts to propose next
    catch_up: int = 0  # tokens those proposals catch up on beyond a steady proposal's


@dataclass
class StepOutcome:
    """A finished step, as the scheduler's update saw it."""

    out: SchedulerOutput
    run: ModelRunnerOutput
    now: float
    # Each request that verified drafts: (request, drafts, accepted, its output tokens
    # before this step's were appended).
    verified: list[tuple[Request, int, int, int]] = field(default_factory=list)
    num_proposed_tokens: int = 0  # proposals handed to requests still running
    departed: list[Request] = field(default_factory=list)


class Speculation(Protocol):
    # A draft model writes K/V for its proposals: their lookahead slots stay reserved.
    writes_draft_kv: bool

    def plan(self, step: DraftStep) -> DraftDecision:
        """Drafts each decoding request verifies this step (added to ``step.scheduled``
        within ``step.budget``) and proposes for the next."""
        ...

    def observe(self, outcome: StepOutcome) -> None:
        """Learn from a finished step (its time, its acceptance, who left)."""
        ...
