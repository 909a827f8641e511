"""The per-step token budget, chosen from SLOs by a step-cost model (``--token-budget slo``).

A fixed ``max_num_batched_tokens`` is right for one load only: a big prefill chunk
stalls every running decode past its TPOT target, a small one starves prefill and
TTFT. The controller decides, each step, how many prefill tokens the step can take:

    begin_step(now, running)   every running decode is priced first (stall-free); the
                               step's time limit is the least time any of them has left
                               before its next token is due
    fit(request, start, upto)  the largest chunk (after ``start`` computed tokens) that
                               keeps the step within the ceiling and the time limit
    add(request, start, n)     commit a row the scheduler scheduled; a chunk that ends
                               the prompt of a request on time for its TTFT target
                               tightens the limit to that target (it must not be late
                               because later chunks made the step longer)
    admit(request, extra)      grow a decode row by ``extra`` draft tokens if it fits
                               (speculative decoding: one budget decision for both)
    end_step(num_tokens)       the per-step histogram

A running request's next token (its k+1-th, k already out) is due at
``first_token_time + k * tpot``: meeting every such deadline keeps its mean TPOT (what
the metrics measure) within the target. The step fits if ``cost_scale *
step_time(shape) <= due - now`` for every running decode with a TPOT target, except one
that cannot meet its target any more even if every remaining step held decodes only
(its TPOT is lost: protecting it would only starve prefill). Likewise, once a chunk
that completes a prompt is in the step and the step would deliver that first token on
time, the step may grow no further than the request's TTFT deadline. A decode that is behind
(its next token due sooner than a decode-only step takes) blocks prefill for this step;
decode-only steps shorter than its target win the time back, and one longer than its
target makes it lost, so prefill is never blocked for good.

``max_num_batched_tokens`` is the ceiling: the controller never schedules more, and
keeps ceiling tokens for every decode it priced, whatever order the policy runs
requests in. Without a cost model there is no controller: the scheduler keeps the
fixed budget (``budget_mode`` says why).

The scheduler owns the calls; the controller never reads a clock (``now`` comes in)
and never imports numpy or torch: the cost model is any ``StepCostModel``
(``conveyor.costs``: a ``conveyor profile`` fit, the roofline, a linear model).
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from conveyor.config import TOKEN_BUDGET_MODES
from conveyor.costs.protocol import StepCostModel
from conveyor.costs.shape import BatchShape
from conveyor.request import Request

logger = logging.getLogger(__name__)


def budget_mode(token_budget: str, policy: str, batching: str,
                step_cost: StepCostModel | None) -> tuple[str, str]:
    """``("slo" | "fixed", why)``: whether a scheduler runs the controller."""
    if token_budget not in TOKEN_BUDGET_MODES:
        raise ValueError(f"token_budget must be one of {', '.join(TOKEN_BUDGET_MODES)}, "
                         f"got {token_budget!r}")
    wanted = token_budget == "slo" or (token_budget == "auto" and policy == "slo")
    if not wanted:
        return "fixed", "max_num_batched_tokens (token_budget " + token_budget + ")"
    if batching != "continuous":
        return "fixed", "max_num_batched_tokens (static batching has no per-step budget)"
    if step_cost is None:
        return "fixed", ("max_num_batched_tokens: no step-cost model was given "
                         "(--slo-cost-model), so the SLO budget controller is off")
    return "slo", "chosen each step from TPOT targets by the step-cost model"


# Upper bounds of the chosen-budget histogram's buckets (tokens); the last is the ceiling.
def _buckets(ceiling: int) -> list[int]:
    out, b = [], 16
    while b < ceiling:
        out.append(b)
        b *= 2
    return [*out, ceiling]


@dataclass
class BudgetStats:
    """Aggregates only (a server runs for days): nothing here grows per step."""

    num_steps: int = 0
    # What bounded each step's tokens: the time limit (a chunk was cut or refused), the
    # ceiling, or the work there was (nothing was cut).
    num_time_bound: int = 0
    num_ceiling_bound: int = 0
    num_demand_bound: int = 0
    # Steps whose decodes alone were predicted past the tightest TPOT deadline.
    num_over_limit: int = 0
    # Running decodes left out of the limit because their TPOT target was already lost
    # (summed over steps).
    num_lost_decodes: int = 0
    # Draft-token requests (admit) granted and refused.
    num_admitted_extra: int = 0
    num_refused_extra: int = 0
    predicted_s_sum: float = 0.0
    chosen_sum: int = 0  # chosen budgets summed over steps (the histogram's sum)
    bucket_bounds: list[int] = field(default_factory=list)
    bucket_counts: list[int] = field(default_factory=list)


class BudgetController:
    def __init__(self, cost: StepCostModel, ceiling: int, cost_scale: float = 1.0) -> None:
        if not cost_scale > 0 or not math.isfinite(cost_scale):
            raise ValueError(f"slo_cost_scale must be a finite number > 0, got {cost_scale}")
        self.cost = cost
        self.ceiling = ceiling
        self.cost_scale = cost_scale
        self.stats = BudgetStats(bucket_bounds=_buckets(ceiling))
        self.stats.bucket_counts = [0] * len(self.stats.bucket_bounds)
        self._reset(math.inf)

    def _reset(self, limit: float) -> None:
        # The step's shape so far, field by field (BatchShape's order).
        self._shape = [0] * 8
        self._tokens = 0
        self.limit_s = limit  # seconds the step may take; inf: no TPOT target runs
        self._cut = False  # a chunk was cut or refused for time this step
        self._ceiling_cut = False
        self._decode_rows: dict[str, int] = {}  # request id -> its start (num computed)
        self._now = 0.0

    # ---- the step ------------------------------------------------------------------------
    def begin_step(self, now: float, running: Iterable[Request]) -> None:
        """Price every running decode and set the step's time limit."""
        self._reset(math.inf)
        self._now = now
        targets: list[tuple[float, int, float]] = []  # (next due, tokens left, tpot)
        for req in running:
            if req.num_uncomputed_tokens != 1:
                continue  # a prefill chunk: priced when the scheduler sizes it
            start = req.num_computed_tokens
            self._add_row(start, 1, True)
            self._decode_rows[req.request_id] = start
            tpot, k = req.slo_tpot_s, req.num_output_tokens
            if tpot is not None and k > 0 and req.first_token_time is not None:
                targets.append((req.first_token_time + k * tpot, req.max_tokens - k, tpot))
        if not targets:
            return
        decode_only = self.predicted_step_s
        limit = math.inf
        for due, left, tpot in targets:
            # Lost: even back-to-back decode-only steps miss the last token's deadline.
            if now + left * decode_only > due + (left - 1) * tpot:
                self.stats.num_lost_decodes += 1
                continue
            limit = min(limit, due - now)
        self.limit_s = limit
        if decode_only > limit:
            self.stats.num_over_limit += 1

    def end_step(self, num_tokens: int) -> None:
        """Record the step: the chosen budget is what it scheduled when time bounded it,
        else the ceiling (the time limit did not bind)."""
        if num_tokens <= 0:
            return
        s = self.stats
        s.num_steps += 1
        s.predicted_s_sum += self.predicted_step_s
        if self._cut:
            s.num_time_bound += 1
            chosen = num_tokens
        else:
            chosen = self.ceiling
            if self._ceiling_cut or num_tokens >= self.ceiling:
                s.num_ceiling_bound += 1
            else:
                s.num_demand_bound += 1
        s.chosen_sum += chosen
        s.bucket_counts[min(bisect.bisect_left(s.bucket_bounds, chosen),
                            len(s.bucket_counts) - 1)] += 1

    # ---- queries -------------------------------------------------------------------------
    @property
    def predicted_step_s(self) -> float:
        """The predicted time of the step as scheduled so far (scaled)."""
        if not self._tokens:
            return 0.0
        return self.cost_scale * self.cost.step_time(BatchShape(*self._shape))

    @property
    def time_left_s(self) -> float:
        """Seconds the step may still grow by before a TPOT deadline would be missed."""
        return self.limit_s - self.predicted_step_s

    @property
    def decode_ids(self) -> frozenset[str]:
        """Requests whose one-token decode ``begin_step`` priced (and no draft grew)."""
        return frozenset(self._decode_rows)

    @property
    def tokens_left(self) -> int:
        """Ceiling tokens not yet taken (every priced decode holds one)."""
        return self.ceiling - self._tokens

    def fit(self, request: Request, start: int, upto: int) -> int:
        """The largest n <= ``upto`` such that a chunk of ``request``'s n tokens after
        ``start`` computed ones keeps the step within the ceiling and the time limit; 0
        if none does. Does not commit: ``add`` does, once the chunk is scheduled."""
        total = request.num_tokens
        n = min(upto, self.tokens_left)
        if n < upto:
            self._ceiling_cut = True
        if n <= 0:
            return 0
        if self.limit_s == math.inf or self._fits(start, n, total):
            return n
        lo, hi = 0, n  # fits(lo) (nothing added), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._fits(start, mid, total):
                lo = mid
            else:
                hi = mid
        self._cut = True
        return lo

    def add(self, request: Request, start: int, n: int) -> None:
        """Commit a chunk the scheduler scheduled (after ``fit``)."""
        if n <= 0:
            return
        samples = start + n >= request.num_tokens
        self._add_row(start, n, samples)
        if samples and request.num_output_tokens == 0 and request.slo_ttft_s is not None:
            # Its first token comes at the step's end: keep it on time if it is.
            left = request.arrival_time + request.slo_ttft_s - self._now
            if self.predicted_step_s <= left < self.limit_s:
                self.limit_s = left

    def admit(self, request: Request, extra_tokens: int) -> bool:
        """Grow ``request``'s decode row by ``extra_tokens`` (speculative decoding's draft
        tokens) if the step stays within the ceiling and the time limit; commits when True.

        The decode was priced by ``begin_step`` as a one-token row; with drafts it becomes
        a row of 1 + extra tokens, attention over its context, one sampled row (the
        rejection sampler's extra logits rows are the cost model's to price, once it
        knows them). One decision for prefill chunks and drafts: whichever asks first
        while time is left gets it, so the scheduler asks in the policy's order.
        """
        start = self._decode_rows.get(request.request_id)
        if extra_tokens <= 0:
            return True
        if start is None or extra_tokens > self.tokens_left:
            self.stats.num_refused_extra += 1
            return False
        saved = list(self._shape), self._tokens
        self._add_row(start, 1, True, sign=-1)
        self._add_row(start, 1 + extra_tokens, True)
        if self.limit_s != math.inf and self.predicted_step_s > self.limit_s:
            self._shape, self._tokens = saved
            self._cut = True
            self.stats.num_refused_extra += 1
            return False
        del self._decode_rows[request.request_id]
        self.stats.num_admitted_extra += 1
        return True

    def predict_prefill_s(self, tokens: int, start: int = 0) -> float:
        """Seconds to prefill ``tokens`` after ``start`` computed ones alone, in ceiling-sized
        chunks: the least time a waiting request still needs before its first token."""
        total, s = 0.0, start
        end = start + tokens
        while s < end:
            n = min(self.ceiling, end - s)
            shape = _row_shape([0] * 8, s, n, s + n >= end)
            total += self.cost.step_time(BatchShape(*shape))
            s += n
        return self.cost_scale * total

    # ---- internals -----------------------------------------------------------------------
    def _fits(self, start: int, n: int, total: int) -> bool:
        shape = _row_shape(list(self._shape), start, n, start + n >= total)
        return self.cost_scale * self.cost.step_time(BatchShape(*shape)) <= self.limit_s

    def _add_row(self, start: int, n: int, samples: bool, sign: int = 1) -> None:
        if sign > 0:
            self._shape = _row_shape(self._shape, start, n, samples)
            self._tokens += n
        else:
            self._shape = _row_shape(self._shape, start, n, samples, -1)
            self._tokens -= n

    def stats_dict(self) -> dict[str, Any]:
        s = self.stats
        return {
            "mode": "slo", "ceiling": self.ceiling, "cost_scale": self.cost_scale,
            "num_steps": s.num_steps, "num_time_bound": s.num_time_bound,
            "num_ceiling_bound": s.num_ceiling_bound, "num_demand_bound": s.num_demand_bound,
            "num_over_limit": s.num_over_limit, "num_lost_decodes": s.num_lost_decodes,
            "num_admitted_extra": s.num_admitted_extra,
            "num_refused_extra": s.num_refused_extra,
            "mean_predicted_step_s": s.predicted_s_sum / s.num_steps if s.num_steps else 0.0,
            # chosen budget per step: {bucket upper bound (tokens): steps}
            "histogram": dict(zip(s.bucket_bounds, s.bucket_counts, strict=True)),
            "histogram_sum": s.chosen_sum,
        }


def _row_shape(shape: list[int], start: int, n: int, samples: bool,
               sign: int = 1) -> list[int]:
    """``shape`` (BatchShape's fields as a list) with a row of ``n`` tokens after ``start``
    added (or removed, ``sign`` -1), split as ``batch_shape`` splits a SchedulerOutput."""
    out = list(shape)
    if n == 1:
        out[4] += sign
        out[5] += sign * (start + 1)
        if sign > 0 and start + 1 > out[6]:
            out[6] = start + 1  # the longest decode context never shrinks within a step
    else:
        out[0] += sign * n
        out[1] += sign
        out[2] += sign * (n * start + n * (n + 1) // 2)
        out[3] += sign * (start + n)
    if samples:
        out[7] += sign
    return out
