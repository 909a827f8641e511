"""Speculative decoding beside the scheduler (``core/speculation.py``'s protocol).

``plan`` gives each decoding request the drafts the ``DraftLengthController`` chose
(within the step's token budget and KV slots, never preempting anyone) and asks for its
next proposals; ``observe`` feeds the finished step to the step-cost fit, the outcome
guard and the acceptance estimates. No torch and no clock: times come in as numbers.
"""

from __future__ import annotations

from conveyor.config import SpeculativeConfig
from conveyor.core.batch_shape import prefill_and_decode_rows
from conveyor.core.speculation import DraftDecision, DraftStep, StepOutcome
from conveyor.costs.protocol import StepCostModel
from conveyor.request import Request, RequestStatus
from conveyor.spec.metrics import SpecMetrics
from conveyor.spec.planner import DraftLengthController, DraftRow
from conveyor.spec.step_cost_fit import BatchStepCost

_RUNNING = RequestStatus.RUNNING


class Speculator:
    def __init__(self, config: SpeculativeConfig, cost: StepCostModel | None = None) -> None:
        """``cost``: what drafts are priced with; by default ``fit``, fitted online to the
        step times the scheduler sees (from ``plan``'s ``now`` to ``observe``'s)."""
        self.config = config
        self.writes_draft_kv = config.writes_draft_kv
        self.fit: BatchStepCost | None = None
        if cost is None:
            cost = self.fit = BatchStepCost()
        self.controller = DraftLengthController(config, cost)
        self._schedule_now: float | None = None
        self._proposed_before = False  # the last step ran the proposer (its next pays)
        # Row counts (prefill tokens + decode rows) some step has run. The first step of
        # a row count pays one-time work (oneDNN builds a primitive per row count on its
        # first call); a drafted one is left out of the step-cost fit and the outcome
        # guard, whose few drafted steps it would tilt against drafts. (Steps without
        # drafts stay in: a prompt's step is what teaches the fit its second size.) At
        # most the token budget of them.
        self._step_rows_seen: set[int] = set()
        # Whether the last step's proposal, if any, was steady (no catch-up: see observe).
        self._after_steady_proposal = True

    @property
    def metrics(self) -> SpecMetrics:
        return self.controller.metrics

    # ---- plan ----------------------------------------------------------------------------
    def plan(self, step: DraftStep) -> DraftDecision:
        self._departed(step.departed)
        self._schedule_now = step.now
        decision = DraftDecision()
        # Drafts take what prefill left of the budget: a prompt token is certain work, a
        # draft only probably saves some.
        self._schedule_drafts(step, decision)
        self._want_after_prefill(step, decision)
        return decision

    def _schedule_drafts(self, step: DraftStep, decision: DraftDecision) -> None:
        """Give decoding requests their draft tokens (the controller picks how many).

        Drafts never preempt anyone: a request whose draft slots do not fit verifies
        none. With a draft model, ``k_want`` more slots are reserved as lookahead: its
        proposals for the next step write K/V there.
        """
        ctl, lookahead, decodes = self.controller, self.writes_draft_kv, step.decodes
        if ctl.dormant(len(decodes)):
            # No drafts this step: the last plan drafted nothing, or the outcome guard
            # keeps them off (proposals from the step before it switched off are void).
            for req in decodes:
                if req.spec_token_ids:
                    req.spec_token_ids = []
            return
        rows = []
        for req in decodes:
            if req.status != _RUNNING:  # preempted for an admission
                req.spec_token_ids = []
                continue
            cap = min(ctl.config.num_speculative_tokens,
                      req.max_tokens - len(req.output_token_ids) - 1,
                      step.max_model_len - req.num_computed_tokens - 1)
            steady = not lookahead or req.spec_proposed_step == step.step_index - 1
            rows.append(DraftRow(req, max(cap, 0), catch_up=(
                0 if steady else len(req.all_token_ids) - req.spec_proposed_len)))
        scheduled = step.scheduled
        num_decode = sum(1 for n in scheduled.values() if n == 1)
        if not ctl.plan(rows, sum(scheduled.values()) - num_decode, num_decode,
                        len(scheduled), step.budget):
            for row in rows:  # nothing verified, nothing proposed
                row.request.spec_token_ids = []
            return
        budget_ctrl = step.budget_ctrl
        for row in rows:
            req, k = row.request, row.k_now
            # Under the SLO budget, drafts and prefill chunks are one decision: a draft
            # goes in only while the step stays within every decode's TPOT limit.
            while k and budget_ctrl is not None and not budget_ctrl.admit(req, k):
                k -= 1
            extra = k + (row.k_want if lookahead else 0)
            if extra and step.kv.allocate_slots(req, 1 + extra) is None:
                k, row.k_want = 0, 0
            rid = req.request_id
            if k:
                scheduled[rid] += k
                decision.spec_tokens[rid] = req.spec_token_ids[:k]
            if row.k_want:
                decision.wanted[rid] = row.k_want
                if row.catch_up > ctl.STEADY_CATCH_UP:
                    decision.catch_up += row.catch_up
                _mark_proposing(req, step.step_index)
            req.spec_token_ids = []  # consumed: the next proposals replace them

    def _want_after_prefill(self, step: DraftStep, decision: DraftDecision) -> None:
        """A request whose prompt ends this step decodes next: ask for its first drafts
        now (as many as the last plan at the next step's batch size chose), so that its
        first decode verifies some. A draft model writes K/V for them: only into slots the
        request already holds."""
        requests, spec = step.requests, decision.spec_tokens
        # The step's sampling requests: those whose tokens (drafts aside) reach their end.
        sampling = [rid for rid, n in step.scheduled.items()
                    if requests[rid].num_computed_tokens + n - len(spec.get(rid, ()))
                    == len(requests[rid].all_token_ids)]
        k = self.controller.k_want_for(len(sampling))
        if k <= 0:
            return
        want, bs = decision.wanted, step.kv.block_size
        for rid in sampling:
            if rid in want or rid in spec:
                continue
            n = k
            if self.writes_draft_kv:
                held = len(step.kv.req_blocks.get(rid, ())) * bs
                n = min(n, held - len(requests[rid].all_token_ids))
            if n > 0:
                want[rid] = n
                req = requests[rid]
                decision.catch_up += len(req.all_token_ids)  # (its whole prompt)
                _mark_proposing(req, step.step_index)

    # ---- observe -------------------------------------------------------------------------
    def observe(self, outcome: StepOutcome) -> None:
        ctl = self.controller
        if self._schedule_now is not None:
            self._observe_time(outcome)
        for req, num_drafts, num_accepted, num_output in outcome.verified:
            ctl.observe(req, num_drafts, num_accepted, num_output)
        ctl.metrics.num_proposed_tokens += outcome.num_proposed_tokens
        self._departed(outcome.departed)

    def _observe_time(self, outcome: StepOutcome) -> None:
        """The step's time, for the step-cost fit and the outcome guard."""
        ctl, out, run = self.controller, outcome.out, outcome.run
        # The step's time without the proposer's (priced apart, per draft asked for; a
        # proposal that also caught up is not what a draft costs when drafting).
        if run.propose_steady and out.num_spec_wanted:
            ctl.observe_proposals(out.num_spec_wanted, run.propose_s)
        elif out.num_spec_wanted:
            ctl.observe_catch_up(out.num_spec_wanted, out.num_spec_catch_up, run.propose_s)
        # The runner's split: verify rows are decode rows (core/batch_shape.py).
        num_prefill, num_decode_rows = prefill_and_decode_rows(out)
        spec = out.scheduled_spec_tokens
        num_drafts = sum(map(len, spec.values())) if spec else 0
        batch = num_decode_rows - num_drafts
        step_s = outcome.now - self._schedule_now - run.propose_s
        rows = num_prefill + num_decode_rows
        # Left out of the fit and the guard: a drafted step of a row count never run
        # before (one-time work: a oneDNN primitive per row count), and one right after
        # a proposal that caught up (a draft model's prefill of a prompt, or of the text
        # since a pause, evicted the target's weights from the caches): counted in, such
        # steps price a decode row far above its cost and keep drafts off.
        steady = not num_drafts or (rows in self._step_rows_seen
                                    and self._after_steady_proposal)
        self._step_rows_seen.add(rows)
        self._after_steady_proposal = run.propose_steady or not out.num_spec_wanted
        # (Dormant steps too: they age the fit's anchors and probes.)
        if self.fit is not None and steady:
            self.fit.observe(num_prefill, num_decode_rows, step_s, batch,
                             self._proposed_before)
        self._proposed_before = run.propose_s > 0.0
        sampled = run.sampled_token_ids  # (a token each, unless drafts were verified)
        ctl.observe_step(batch, num_prefill, num_drafts,
                         sum(map(len, sampled.values())) if spec else len(sampled),
                         step_s, run.propose_s, steady)

    def _departed(self, requests: list[Request]) -> None:
        for req in requests:
            self.controller.request_done(req)


def _mark_proposing(req: Request, step_index: int) -> None:
    """``req`` proposes after this step: a draft model's K/V for it will be valid up to
    its tokens now (and the ones this step adds), and a proposal in the next step is
    steady (``DraftRow.catch_up`` 0)."""
    req.spec_proposed_len = len(req.all_token_ids)
    req.spec_proposed_step = step_index
