"""How one step's prefill tokens are shared by running prefills and new arrivals.

A step is filled in this order (``Scheduler.schedule``):

  1. running decodes, one token each: a chunk never stalls them;
  2. running short prefills, in the policy's running order;
  3. waiting requests, in the policy's waiting order;
  4. running long prefills: the first ``max_long_partial_prefills`` in the policy's running
     order advance, the others pause (they keep their blocks: nothing is recomputed).

Steps 2 and 3 may use the prefill budget (what the decodes left) less the long prefills'
reserve, ``min(their prompt tokens left, ceil(long_prefill_min_share * prefill budget))``;
step 4 gets the rest, so a long prefill is never slowed when nobody else wants tokens
and short prompts pass beside it when they do. The guarantee: the first long prefill in
the policy's order computes at least ``min(left, ceil(share * prefill budget))`` tokens
every step (unless the KV pool makes it preempt), so its prefill takes at most ``1 /
share`` times its steps alone.

Caps: at most ``max_num_partial_prefills`` prefills advance in a step without ending
(the reserved long ones counted first). A waiting long prompt that finds the long cap
full is admitted paused (no tokens this step) while fewer than
``max_num_partial_prefills`` long prefills run (paused ones hold sequence slots and
blocks); otherwise it stays queued, in its place, and the scan passes over it for this
step. Either way the prompts behind it in the queue still pass: a long prompt waits for
the long cap, never a short one behind it. The queued long prompts keep their order (they
start when the cap frees, at the head of the queue) and take their cached prefix when
they start. At most ``MAX_PASSED_OVER`` are passed over in a step, so a step's scan stays
bounded when the queue is full of long prompts. No clock and no tensor here either:
counts only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from conveyor.config import SchedulerConfig
from conveyor.request import Request

# Queued long prompts the waiting scan may pass over in one step (the long cap full):
# short prompts queued behind more of them than this wait until some start. Each one
# passed costs a prefix-cache lookup of its prompt, hence a small bound.
MAX_PASSED_OVER = 8


@dataclass
class PrefillSplit:
    """One step's plan for its prefills, and the counts the caps check."""

    threshold: int
    max_partial: int
    max_long: int
    short: list[Request] = field(default_factory=list)  # running, in policy order
    advancing_long: list[Request] = field(default_factory=list)
    paused_long: list[Request] = field(default_factory=list)
    reserve: int = 0  # prefill tokens steps 2-3 leave for the advancing long prefills
    num_partial: int = 0  # prefills advancing this step without ending, reserved included
    num_long: int = 0  # long prefills advancing this step
    num_long_running: int = 0  # long prefills running, advancing or paused
    admitted: set[str] = field(default_factory=set)  # admitted this step: never victims
    waived: bool = False  # the long prefills keep no share this step (``waive``)
    num_passed_over: int = 0  # queued long prompts the waiting scan passed this step

    @classmethod
    def plan(cls, config: SchedulerConfig, prefills: list[Request],
             budget: int) -> PrefillSplit:
        """``prefills``: running requests with prompt (or recomputed) tokens left, in the
        policy's running order; ``budget``: the tokens the decodes left."""
        if config.batching == "static":  # the baseline batch runs whole: no caps
            split = cls(config.long_prefill_threshold, len(prefills) + 1, len(prefills) + 1)
        else:
            split = cls(config.long_prefill_threshold, config.max_num_partial_prefills,
                        config.max_long_partial_prefills)
        for req in prefills:
            if not split.is_long(req.num_uncomputed_tokens):
                split.short.append(req)
            elif len(split.advancing_long) < split.max_long:
                split.advancing_long.append(req)
            else:
                split.paused_long.append(req)
        wanted = sum(r.num_uncomputed_tokens for r in split.advancing_long)
        share = math.ceil(config.long_prefill_min_share * max(budget, 0))
        split.reserve = min(wanted, share)
        split.num_partial = split.num_long = len(split.advancing_long)
        split.num_long_running = len(split.advancing_long) + len(split.paused_long)
        return split

    def waive(self) -> None:
        """A more urgent request waits (the policy says): the long prefills keep no
        reserve and no place under the caps; they take what is left, if the caps allow."""
        self.waived = True
        self.reserve = 0
        self.num_partial -= len(self.advancing_long)
        self.num_long -= len(self.advancing_long)

    def is_long(self, tokens_left: int) -> bool:
        return tokens_left > self.threshold

    @property
    def long_full(self) -> bool:
        return self.num_long >= self.max_long

    @property
    def may_admit_paused(self) -> bool:
        """Whether a waiting long prompt may join the running ones paused: at most
        ``max_num_partial_prefills`` long prefills hold sequence slots and blocks at once,
        so that paused ones never crowd out the decodes."""
        return self.num_long_running < self.max_partial

    def pass_over(self) -> bool:
        """Whether the waiting scan may pass over one more queued long prompt that the
        long cap keeps from starting (and count it)."""
        if self.num_passed_over >= MAX_PASSED_OVER:
            return False
        self.num_passed_over += 1
        return True

    def may_advance(self, tokens_left: int, num_new: int) -> bool:
        """Whether a prefill may compute ``num_new`` of its ``tokens_left`` this step."""
        if num_new >= tokens_left:
            return True  # it ends this step: not a partial prefill
        if self.is_long(tokens_left) and self.long_full:
            return False
        return self.num_partial < self.max_partial

    def count(self, tokens_left: int, num_new: int) -> None:
        """Record a short or newly admitted prefill that advances this step."""
        if self.is_long(tokens_left) and num_new < tokens_left:
            self.num_long_running += 1
        if 0 < num_new < tokens_left:
            self.num_partial += 1
            if self.is_long(tokens_left):
                self.num_long += 1

    def close_step(self, running: list[Request], scheduled: dict[str, int], now: float,
                   stats: Any) -> None:
        """Count the step's partial prefills and keep the pause clocks of running prefills
        (``stats``: the scheduler's ``SchedulerStats``). Called before the step's tokens
        are counted as computed."""
        num_partial = 0
        for req in running:
            left = req.num_uncomputed_tokens
            got = scheduled.get(req.request_id, 0)
            if left > 1 and 0 < got < left:
                num_partial += 1
            if left <= 1 or got > 0:
                if req.paused_since is not None:  # resumed (or it was a decode all along)
                    req.prefill_paused_s += now - req.paused_since
                    stats.prefill_paused_s += now - req.paused_since
                    req.paused_since = None
            elif req.paused_since is None:
                req.paused_since = now  # a prefill that got nothing this step
                stats.num_paused_prefills += 1
        stats.num_partial_prefills += num_partial
        stats.peak_partial_prefills = max(stats.peak_partial_prefills, num_partial)
