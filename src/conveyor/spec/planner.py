"""How many draft tokens each request verifies this step: expected benefit against cost.

Each step the scheduler hands over its decoding requests (after every running request
got its one token). Draft slot ``j`` of request ``r`` is worth ``P(drafts 1..j of r all
survive)`` expected tokens; it costs the marginal step time of one more token, from a
step-cost model, plus what proposing it costs (a share of the proposal call, a new
draft position's round, the draft itself: ``ProposalCost``). Slots are ordered best
first, and the plan is the prefix of that order with the highest

    E / (T0 + margin x (T - T0))

the step's expected tokens ``E`` per second with every added cost (``T - T0``) taken
``margin`` = 1.2 times (``BENEFIT_MARGIN``), if it beats no drafts' ``E0 / T0``. Where
each slot costs at least the one before, that is taking slots while
``P(first j survive) x (T / E) >= margin x dT`` (the value of a saved step, shared by
everyone in the batch, against the slot's cost); a proposal's own cost makes a first
draft dear and the next ones cheap, which a prefix sees and a first refusal would not.
Under saturation the average ``T / E`` falls to the marginal ``dT`` and ``k`` falls to
0 by itself; at batch 1, where a step's fixed cost dominates, nearly every slot pays.

Acceptance is tracked online per position (the probability that draft ``j`` survives
given drafts ``1..j-1`` did), per request and per proposer, counted the honest way: up
to the first rejection. No torch and no clock: step times come in as numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config import SpeculativeConfig
from conveyor.costs.protocol import StepCostModel
from conveyor.costs.shape import BatchShape
from conveyor.request import Request
from conveyor.spec.acceptance import GLOBAL_DECAY, REQUEST_DECAY, PriorWeight, own_counts
from conveyor.spec.metrics import SpecMetrics
from conveyor.spec.outcome_guard import OutcomeGuard
from conveyor.spec.proposal_cost import ProposalCost


@dataclass
class DraftRow:
    """A decoding request's draft decision for this step (filled by ``plan``)."""

    request: Request
    cap: int  # the most drafts its max_tokens / max_model_len allow
    k_now: int = 0  # drafts verified this step (<= what it has on hand)
    k_want: int = 0  # drafts to propose for its next step
    # Tokens a draft model would catch up on before this request's first draft (the
    # text since it last proposed; 0 for other proposers).
    catch_up: int = 0


class DraftLengthController:
    # Every this many steps where the rule drafts, one request proposes one draft more
    # than the rule chose (and verifies it next step): the only way a position that looked
    # bad once (its few early tries failed) is ever tried again, since the rule prices a
    # position by its measured acceptance and a position never verified is never measured.
    EXPLORE_EVERY = 16
    # After a plan that drafts nothing (adaptive), the next steps at the same batch size
    # reuse it, this many in all before planning afresh: nothing was verified, so no
    # acceptance moved, and the step-cost fit moves slowly (on a small model a full
    # plan is a visible share of a step). Each further plan in a row at that size that
    # drafts nothing doubles the reuse, up to MAX_DORMANT_DOUBLINGS times (the rule's
    # probes wait for a plan: at most DORMANT_STEPS << MAX_DORMANT_DOUBLINGS steps late).
    DORMANT_STEPS = 8
    MAX_DORMANT_DOUBLINGS = 3
    # A slot is taken only if it is worth this many times its cost: one that barely pays
    # gains next to nothing, and what the cost model leaves out (a drafted step's verify
    # work, the fit's noise) makes it lose, and the outcome guard then switches it off
    # again after every cool-off.
    BENEFIT_MARGIN = 1.2
    # Whether a plan prices drafts against the whole step, prefill chunks included (the
    # earlier rule, kept for in-process A/Bs): see ``_plan_by_benefit``.
    PRICE_PREFILL = False

    def __init__(self, config: SpeculativeConfig, cost: StepCostModel | None) -> None:
        """``cost``: what a step costs; a fit with linear ``coefficients(batch)`` (the
        online ``BatchStepCost``) is read directly."""
        self.config = config
        self.cost = cost
        self._dormant_batch = -1
        self._dormant_left = 0
        self._dormant_run = 0  # further plans in a row at _dormant_batch drafting nothing
        self._priced = False  # the last plan knew the step's cost (its fit had two sizes)
        self._full_caps = True  # the last plan had a row that could take every draft
        self._explore_age = 0
        self._explored: set[str] = set()  # requests that proposed one more last step
        self.proposal_cost = ProposalCost()
        # A draft model's seconds per token of catch-up (``observe_catch_up``; None until
        # measured: the plan prices catch-ups from the first one seen on).
        self.catch_up_s_per_token: float | None = None
        self.guard = OutcomeGuard()
        self.prior_weight = PriorWeight()
        k = config.num_speculative_tokens
        # Proposer-wide decayed (accepted, tried) per position. Draft 1's start as 1 in 2;
        # a later position's hold only its own tries, and ``prior`` adds one pseudo-try
        # at the estimate of the position before it.
        self._glob_acc = [0.5] + [0.0] * (k - 1)
        self._glob_try = [1.0] + [0.0] * (k - 1)
        self.metrics = SpecMetrics(config.method, k)
        # Whether a request's own record fades while it does not draft (REQUEST_DECAY's
        # note). Not for a draft model: a request that resumes drafting pays a catch-up
        # on the text since, which no fit prices.
        self.fade_idle = not config.writes_draft_kv
        # The largest draft length chosen in the last step at each batch size (power-of-two
        # bucket of decoding requests): what a request that starts decoding next step is
        # asked for (``k_want_for``).
        self._k_want_at: dict[int, int] = {}

    # ---- acceptance ----------------------------------------------------------------------
    def prior(self) -> list[float]:
        """The proposer-wide estimate per position (every request's, decayed). A position
        tried rarely leans on the one before it (one pseudo-try at its estimate), not on
        1 in 2: positions are tried only where the ones before them were accepted, so a
        later one starts unmeasured, and priced at 1 in 2 it would stay untried (the plan
        stopping short of it while the positions before it are accepted)."""
        out, before = [], 0.5
        for acc, tried in zip(self._glob_acc, self._glob_try):
            before = (acc + before) / (tried + 1.0) if out else acc / tried
            out.append(before)
        return out

    def acceptance(self, req: Request, prior: list[float] | None = None) -> list[float]:
        """Estimated P(draft j survives | drafts before it did), j = 1..k."""
        own = own_counts(req, self.fade_idle)
        if prior is None:
            prior = self.prior()
        if own is None:
            return prior
        w = self.prior_weight.weight
        return [(acc + w * p) / (tried + w) for (acc, tried), p in zip(own, prior)]

    def observe_proposals(self, wanted: dict[str, int], seconds: float) -> None:
        """The proposer took ``seconds`` for the drafts ``wanted`` (request -> k)."""
        if wanted:
            self.proposal_cost.observe(max(wanted.values()), sum(wanted.values()), seconds)

    # Catch-ups up to this many tokens are a steady proposal's (the token or two the last
    # step added), which the proposal cost already holds.
    STEADY_CATCH_UP = 2

    def observe_catch_up(self, wanted: dict[str, int], tokens: int, seconds: float) -> None:
        """A proposal of ``wanted`` that also caught up on ``tokens`` (beyond the steady
        ones) took ``seconds``: what it took over a steady proposal of those drafts,
        per token, folded into a running mean (half each)."""
        if tokens <= 0 or not wanted:
            return
        c, a, b = self.proposal_cost.coefficients()
        extra = seconds - (c + a * max(wanted.values()) + b * sum(wanted.values()))
        per_token = max(extra, 0.0) / tokens
        prev = self.catch_up_s_per_token
        self.catch_up_s_per_token = per_token if prev is None else 0.5 * (prev + per_token)

    def observe_step(self, batch: int, num_prefill_tokens: int, num_drafts: int,
                     num_emitted: int, step_s: float, propose_s: float,
                     steady: bool = True) -> None:
        """A finished step, for the outcome guard (``step_s`` without ``propose_s``;
        ``steady`` False: it paid one-time work, such as its row count's first run)."""
        if self.config.adaptive:
            self.guard.observe(batch, num_prefill_tokens, num_drafts, num_emitted,
                               step_s, propose_s, steady)
            self.metrics.num_guard_switch_offs = self.guard.num_switched_off
            self.metrics.num_guard_trials = self.guard.num_trials

    def observe(self, req: Request, num_drafts: int, num_accepted: int,
                num_output: int | None = None) -> None:
        """Fold in one verification: ``num_accepted`` leading drafts of ``num_drafts``,
        verified when the request had ``num_output`` output tokens (None: its count now,
        before the step's tokens are appended)."""
        if num_output is None:
            num_output = req.num_output_tokens
        if num_drafts <= 0:
            return
        m = self.metrics
        m.num_draft_tokens += num_drafts
        m.num_accepted_tokens += num_accepted
        m.num_verify_steps += 1
        own = own_counts(req, self.fade_idle, num_output)
        if own is None:
            k = self.config.num_speculative_tokens
            own = [[0.0, 0.0] for _ in range(k)]
        req.spec_acceptance = own
        # (This step emits num_accepted + 1 tokens after those.)
        req.spec_seen_at = num_output + num_accepted + 1
        for pos in range(len(own)):
            own[pos][0] *= REQUEST_DECAY
            own[pos][1] *= REQUEST_DECAY
        req.spec_first_tries += 1
        req.spec_first_hits += num_accepted > 0
        # Positions up to the first rejection were tried; the ones after it were not.
        for j in range(min(num_drafts, num_accepted + 1)):
            ok = 1.0 if j < num_accepted else 0.0
            own[j][0] += ok
            own[j][1] += 1.0
            self._glob_acc[j] = self._glob_acc[j] * GLOBAL_DECAY + ok
            self._glob_try[j] = self._glob_try[j] * GLOBAL_DECAY + 1.0
            m.accepted_per_position[j] += int(ok)
        for j in range(num_drafts):
            m.drafted_per_position[j] += 1

    def request_done(self, req: Request) -> None:
        """A request left: its draft-1 record goes into the prior's weight."""
        if req.spec_first_tries:
            self.prior_weight.observe(req.spec_first_hits, req.spec_first_tries)

    # ---- the decision --------------------------------------------------------------------
    def dormant(self, batch: int) -> bool:
        """True when this step drafts nothing and needs no plan: it reuses the last plan
        at this batch size, which drafted nothing (see ``DORMANT_STEPS``), or the outcome
        guard keeps drafts off at this size. No rows to build, no drafts, no proposals."""
        if self.config.adaptive and batch and not self.guard.allows(batch):
            self._guard_off(batch)
            return True
        if self._dormant_left <= 0 or batch != self._dormant_batch:
            return False
        self._dormant_left -= 1
        self.metrics.num_decode_steps += batch
        self.metrics.last_num_draft_tokens = 0
        return True

    def _guard_off(self, batch: int) -> None:
        # Drafts were measured to lose at this batch size: none, and no proposals.
        # (Not dormant: a trial's or a cool-off's end is seen at once.)
        self.metrics.num_decode_steps += batch
        self.metrics.num_guard_off_steps += 1
        self.metrics.last_num_draft_tokens = 0
        self._set_k_want(batch, 0)
        self._explored = set()

    def _set_k_want(self, batch: int, k: int) -> None:
        self._k_want_at[batch.bit_length()] = k

    def k_want_for(self, batch: int) -> int:
        """Drafts to propose for a request whose prompt ends this step, so that its first
        decode verifies some, in a step of ``batch`` decoding requests: what the last
        plan at that batch size chose. A size not planned yet takes the nearest smaller
        one's (drafts that do not pay at a size pay at no larger one, and a draft model's
        catch-up on whole prompts for drafts the next plan refuses is pure loss), and
        ``num_speculative_tokens`` before any plan."""
        key = batch.bit_length()
        for b in range(key, 0, -1):
            k = self._k_want_at.get(b)
            if k is not None:
                return k
        return self.config.num_speculative_tokens

    def _drafts_nothing(self, batch: int) -> bool:
        self.metrics.last_num_draft_tokens = 0
        if not self._full_caps:
            return False  # (see plan: a plan bounded by caps decides nothing)
        self._set_k_want(batch, 0)
        if self.config.adaptive and self._priced:  # (unpriced: a probe is due soon)
            run = self._dormant_run + 1 if batch == self._dormant_batch else 0
            self._dormant_batch, self._dormant_run = batch, run
            self._dormant_left = (self.DORMANT_STEPS
                                  << min(run, self.MAX_DORMANT_DOUBLINGS)) - 1
        return False

    def plan(self, rows: list[DraftRow], num_prefill_tokens: int, num_decode_rows: int,
             num_expected_tokens: int, budget: int) -> bool:
        """Fill each row's ``k_now`` and ``k_want``; False when every one is 0.

        ``num_prefill_tokens``, ``num_decode_rows``: the step so far (every running
        request's tokens); ``num_expected_tokens``: tokens it yields without drafts (its
        sampling rows); ``budget``: token budget left for drafts.
        """
        if not rows:
            self.metrics.last_num_draft_tokens = 0
            return False
        if self.config.adaptive and not self.guard.allows(len(rows)):
            self._guard_off(len(rows))
            return False
        self.metrics.num_decode_steps += len(rows)
        if not any(r.cap for r in rows):
            # Every request is on its last token: no draft could be verified, whatever
            # it cost, so this step says nothing about whether drafts pay at this size.
            # Recorded as "none" (k_want_for, dormancy), it would make the next request
            # start without drafts, in a run of dormant plans.
            self.metrics.last_num_draft_tokens = 0
            self._explored = set()
            return False
        # Whether some row could take every draft: a plan over requests that are all
        # near their end (caps below k) is bounded by their caps, not by what drafts
        # are worth at this size, so it does not tell a new request what to propose nor
        # put the next plans to sleep. (At batch 1, a one-slot plan that did not pay a
        # proposal's cost recorded "none"; the next request then skipped its first
        # proposal, and a catch-up over its whole prompt, charged to one step's drafts,
        # kept it from drafting for the rest of its life.)
        self._full_caps = any(r.cap >= self.config.num_speculative_tokens for r in rows)
        probed = explored = None
        verify_all, self._explored = self._explored, set()
        if self.config.adaptive:
            self._plan_by_benefit(rows, num_prefill_tokens, num_decode_rows,
                                  max(num_expected_tokens, 1))
            needs_anchor = getattr(self.cost, "needs_anchor", None)
            probe = getattr(self.cost, "probe", None)
            if needs_anchor is not None and needs_anchor(len(rows)):
                budget = 0  # verify none this step (proposals go on: no step is lost twice)
            elif probe is not None and probe(len(rows), any(r.k_want for r in rows)):
                # The rule drafts nothing here: a few requests propose, and verify what
                # they have on hand, so the fit sees a step with drafts again.
                self.metrics.num_probe_steps += 1
                probed = self._probe_rows(rows)
            else:
                explored = self._explore(rows)
        else:
            for row in rows:
                row.k_want = row.cap
        probed_ids = {id(r) for r in probed} if probed else ()
        if not verify_all and not any(r.k_want for r in rows):
            # Nothing proposed or verified (the common case under load): rows stay at 0.
            return self._drafts_nothing(len(rows))
        # This step verifies what each request has on hand, best rows first, within budget.
        left = max(budget, 0)
        for row in sorted(rows, key=lambda r: -r.k_want):
            want = row.k_want
            if verify_all and row.request.request_id in verify_all:
                want = max(want, min(len(row.request.spec_token_ids), row.cap))
            row.k_now = min(want, len(row.request.spec_token_ids), left)
            left -= row.k_now
        self.metrics.last_num_draft_tokens = sum(r.k_now for r in rows)
        self._dormant_batch = -1  # (a plan that drafts ends a run of dormant ones)
        # What a request that starts decoding next step is asked for: the rule's choice,
        # not a probe's or an exploration's.
        if self._full_caps:
            self._set_k_want(len(rows), max(
                (r.k_want - (r is explored) for r in rows if id(r) not in probed_ids),
                default=0))
        return True

    # Drafts a probe verifies, at most: the slope of a decode row comes from the probe's
    # step against the draft-free ones, whose time is noisy; a few drafts spread that
    # noise over few rows, price a row far above its cost, and the rule then refuses
    # for good. Every probed request of a draft model pays a catch-up: at most
    # PROBE_DRAFT_MODEL_ROWS of them, each to its cap (a probe of one draft each is too
    # few rows to read the slope from).
    PROBE_DRAFTS = 16
    PROBE_DRAFT_MODEL_ROWS = 4

    def _probe_rows(self, rows: list[DraftRow]) -> list[DraftRow]:
        """The probe's rows, their ``k_want`` set: requests in a fixed order (by id), each
        to its cap, until ``PROBE_DRAFTS`` drafts (a draft model's from at most
        ``PROBE_DRAFT_MODEL_ROWS`` requests)."""
        per_row = self.config.num_speculative_tokens
        max_rows = self.PROBE_DRAFT_MODEL_ROWS if self.config.writes_draft_kv else len(rows)
        left = self.PROBE_DRAFTS
        probed = []
        for row in sorted(rows, key=lambda r: r.request.request_id):
            if left <= 0 or len(probed) >= max_rows:
                break
            k = min(row.cap, per_row, left)
            if k > 0:
                row.k_want = k
                left -= k
                probed.append(row)
        return probed

    def _explore(self, rows: list[DraftRow]) -> DraftRow | None:
        """Every ``EXPLORE_EVERY`` steps where the rule drafts: the row drafting most
        (below its cap) proposes one more, verified at its next step whatever the rule
        says then (``plan``'s ``verify_all``)."""
        self._explore_age += 1
        if self._explore_age < self.EXPLORE_EVERY:
            return None
        best = None
        for row in rows:
            if 0 < row.k_want < row.cap and (best is None or row.k_want > best.k_want):
                best = row
        if best is not None:
            self._explore_age = 0
            best.k_want += 1
            self._explored.add(best.request.request_id)
            self.metrics.num_explore_steps += 1
        return best

    # A catch-up is paid once and serves every later step's drafts (each proposal after
    # it is steady): its price is spread over the steps the request then verifies
    # drafts for, up to this many. Charged whole to one step's drafts, a catch-up over a
    # prompt costs more than a step and never pays, and grows while the request waits.
    CATCH_UP_HORIZON = 8

    def _catch_up_steps(self, row: DraftRow, prior: list[float]) -> float:
        """Steps a request's catch-up is spread over: its remaining output at the tokens
        a step drafting to its cap yields, between 1 and ``CATCH_UP_HORIZON``."""
        survive, per_step = 1.0, 1.0
        for a in self.acceptance(row.request, prior)[:row.cap]:
            survive *= a
            per_step += survive
        req = row.request
        left = req.max_tokens - req.num_output_tokens
        return min(float(self.CATCH_UP_HORIZON), max(1.0, left / per_step))

    def _plan_by_benefit(self, rows: list[DraftRow], num_prefill: int, num_decode: int,
                         expected: int) -> None:
        cost = self.cost
        batch = len(rows)
        self._priced = False
        # Drafts are priced against the step's decode part alone: a prefill chunk's time
        # buys prompt tokens, not sampled ones, and counted in T0 it made drafts look
        # cheap (a long prefill chunk yields a token per decode in a long step), so such
        # a step drafted for requests that then caught up on whole prompts, for drafts
        # verified in the decode-only steps after it, where they did not pay.
        if not self.PRICE_PREFILL:
            num_prefill = 0
        coefficients = getattr(cost, "coefficients", None)
        if coefficients is not None:  # one solve for both (the fit is linear)
            coef = coefficients(batch)
            if coef is None:
                return  # no cost known yet (two step sizes teach it): no drafts
            t0 = coef[0] + coef[1] * num_prefill + coef[2] * num_decode
            slope = coef[2]
        elif cost is not None:  # any other step-cost model: one more decode row's price
            shape = BatchShape(num_prefill_tokens=num_prefill,
                               num_prefills=int(num_prefill > 0), num_decodes=num_decode)
            t0 = cost.step_time(shape)
            slope = max(cost.step_time(shape._replace(num_decodes=num_decode + 1)) - t0, 0.0)
        else:
            return  # no cost model: no drafts
        self._priced = True
        per_call, per_round, per_draft = self.proposal_cost.coefficients()
        # (and what the proposal costs the next forward: the step-cost fit's own term)
        after = getattr(cost, "after_proposal_s", None)
        if after is not None:
            per_call += after(batch)
        prior = self.prior()
        margin = self.BENEFIT_MARGIN
        # No slot is worth more than the best first draft of any request, nor costs less
        # than its row and its draft plus its share of one proposal and one round over
        # every slot there is: if even that does not pay, nothing does (the common case
        # under load, decided in O(requests)).
        w, p0 = self.prior_weight.weight, prior[0]
        best = max((p0 if (own := own_counts(r.request, self.fade_idle)) is None
                    else (own[0][0] + w * p0) / (own[0][1] + w)) for r in rows)
        slots = sum(r.cap for r in rows)
        # (A draft model's request that starts drafting catches up first, on the text
        # since it last proposed: a forward's worth that the fit of steady proposals does
        # not see. Its first draft is bounded by a round of its own: amortized over
        # every slot, single drafts get through at large batches and pay catch-ups.)
        share = per_round if self.config.writes_draft_kv else (per_call + per_round) / max(
            slots, 1)
        if slots <= 0 or t0 <= 0.0 or best * t0 < margin * expected * (
                slope + per_draft + share):
            return
        cands: list[tuple[float, int, DraftRow]] = []
        for row in rows:
            survive = 1.0
            for j, a in enumerate(self.acceptance(row.request, prior)[:row.cap], start=1):
                survive *= a
                cands.append((survive, j, row))
        per_catch = (self.catch_up_s_per_token or 0.0) if self.config.writes_draft_kv else 0.0
        steady_catch = self.STEADY_CATCH_UP
        charged = {id(r) for r in rows if per_catch > 0.0 and r.catch_up > steady_catch}
        # (Rows charged a catch-up come after the steady ones, best first among
        # themselves: one at the front would end every prefix that pays.)
        cands.sort(key=lambda c: (id(c[2]) in charged, -c[0], c[1]))
        # Slots best first, each plan a prefix of them; the plan kept is the prefix of
        # the highest rate ``E / (T0 + margin x (T - T0))``: the step's expected tokens
        # per second with every added cost taken ``margin`` times, against no drafts'
        # ``E0 / T0``. Not the first slot that does not pay: a proposal's own cost and
        # each new round come at once, so a slot that does not pay alone can with the
        # ones after it (k = 4 where k = 1 loses).
        t, e, rounds = t0, float(expected), 0
        best_rate, best_n = e / t0, 0
        taken: list[DraftRow] = []
        floor = margin * (slope + per_draft)  # the least any further slot costs
        # A draft model's request that did not propose last step catches up first on the
        # text since it did (its whole prompt, the step after its prefill): a
        # draft-model forward over those tokens (``catch_up_s_per_token``, measured),
        # charged to its first draft, spread over the steps it then drafts for
        # (``_catch_up_steps``).
        for survive, j, row in cands:
            if survive <= best_rate * floor:
                if not charged or id(row) in charged:
                    break  # no slot from here on is worth the rate already had
                continue  # (on to the charged rows' best slots)
            if j != row.k_want + 1:
                continue  # (ties: its draft j - 1 comes first)
            cost = (slope + per_draft + (per_round if j > rounds else 0.0)
                    + (0.0 if taken else per_call))
            if j == 1 and id(row) in charged:
                cost += per_catch * row.catch_up / self._catch_up_steps(row, prior)
            row.k_want = j
            taken.append(row)
            rounds = max(rounds, j)
            t += cost
            e += survive
            rate = e / (t0 + margin * (t - t0))
            if rate > best_rate:
                best_rate, best_n = rate, len(taken)
        for row in taken[best_n:]:  # (each entry took one slot of its row)
            row.k_want -= 1
