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

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from conveyor.config import SpeculativeConfig
from conveyor.request import Request

# How fast a request's old observations fade (per observation), and the proposer-wide
# estimate's (per draft position tried).
_REQUEST_DECAY = 0.9
_GLOBAL_DECAY = 0.995
# A request's own counts also fade by _REQUEST_DECAY per output token it emitted without
# verifying drafts (``DraftLengthController.fade_idle``): acceptance runs in stretches of
# the text (a loop the drafts follow, then code they cannot guess), and what failed a
# stretch ago says less about the text now. Without it a request whose estimate fell in
# one bad stretch stays below the rule's bar (nothing verified, nothing moves it) until
# a probe. Measured with the trained draft at batch 1 (drafts 1.00 a token with it
# against 0.36, 1.17x off against 1.04x, one in-process A/B), where it is then kept off;
# n-gram on the trained pair, with it and without: 1.095x / 1.102x at batch 16, 0.973x /
# 0.948x at batch 64 (neutral within this VM's noise).


def _own_counts(req: Request, fade: bool = True) -> list[list[float]] | None:
    """The request's [accepted, tried] per position, faded by the tokens since."""
    own = req.spec_acceptance
    if own is None or not fade:
        return own
    idle = req.num_output_tokens - req.spec_seen_at
    if idle <= 0:
        return own
    f = _REQUEST_DECAY ** idle
    return [[acc * f, tried * f] for acc, tried in own]


class PriorWeight:
    """How much the proposer-wide acceptance estimate weighs in a request's own: the
    pseudo-count ``w`` of a beta prior, by the method of moments over finished requests
    (beta-binomial). With ``p`` the mean of requests' rates at draft 1 and ``V`` their
    variance beyond each one's sampling noise (``r (1 - r) / (n - 1)`` for a rate of
    ``n`` tries), a beta prior of weight ``w`` has ``V = p (1 - p) / (w + 1)``.

    Requests that differ (an n-gram on code that repeats itself against code that does
    not) make ``w`` small: a request's own record decides. Requests that are alike (a
    draft model's, on one kind of text) make it large: one rejection does not stop a
    request's drafts for good. (With a fixed ``w`` of 2, one rejection at draft 1 took
    the trained draft model's estimate from 0.74 to 0.49 and its drafts off; nothing
    verified, nothing moved it back: 141 of 3,698 decode steps at batch 1 verified
    drafts.) ``LOW`` until ``MIN_REQUESTS`` requests of ``MIN_TRIES`` tries finished.
    (A weight of 8 there instead drafted less in three in-process A/Bs with the trained
    draft at batch 1 on a 2-core Zen 3: 0.20, 0.62, 0.35 drafts a token against 0.48,
    0.77, 0.50; it pulls a request in a good stretch down to the proposer's mean.)"""

    LOW, HIGH = 2.0, 64.0
    MIN_REQUESTS = 8
    MIN_TRIES = 2
    DECAY = 0.98  # per finished request: the last ~50 count

    def __init__(self) -> None:
        self._count = 0
        self._n = self._s = self._s2 = self._noise = 0.0
        self._weight = self.LOW

    def observe(self, hits: int, tries: int) -> None:
        """A finished request accepted draft 1 ``hits`` times in ``tries``."""
        if tries < self.MIN_TRIES:
            return
        r, d = hits / tries, self.DECAY
        self._count += 1
        self._n = self._n * d + 1.0
        self._s = self._s * d + r
        self._s2 = self._s2 * d + r * r
        self._noise = self._noise * d + r * (1.0 - r) / (tries - 1)
        self._weight = self._solve()

    def _solve(self) -> float:
        if self._count < self.MIN_REQUESTS:
            return self.LOW
        n = self._n
        p = self._s / n
        spread = p * (1.0 - p)
        between = self._s2 / n - p * p - self._noise / n
        if spread <= 0.0 or between * (self.HIGH + 1.0) <= spread:
            return self.HIGH  # alike (or all at 0 or 1): the proposer-wide estimate
        return min(max(spread / between - 1.0, self.LOW), self.HIGH)

    @property
    def weight(self) -> float:
        return self._weight


class StepCost(Protocol):
    def step_s(self, num_prefill_tokens: int, num_decode_rows: int,
               batch: int = 0) -> float | None:
        """Predicted seconds of a step (None: not known yet). Prefill tokens and decode
        rows apart: a decode row (a draft is one) also carries per-row work that a
        batched prompt token does not (its attention over the cache, its bookkeeping).
        ``batch``: decoding requests in the step (a fit local to that size may answer)."""
        ...


def _solve(m: list[list[float]], v: list[float],
           min_det_ratio: float = 0.0) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular, or if ``|det m|``
    (the product of the pivots) is at most ``min_det_ratio`` x the product of ``m``'s
    diagonal: for normal equations, features too nearly collinear to tell apart."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    diag = det = 1.0
    # (Loops written out, the pivot row held in locals: the step-cost fit solves a 4 x 4
    # on the scheduler's hot path.)
    for c in range(n):
        diag *= m[c][c]
        piv, best = c, abs(a[c][c])
        for r in range(c + 1, n):
            x = abs(a[r][c])
            if x > best:
                piv, best = r, x
        if best < 1e-12:
            return None
        a[c], a[piv] = a[piv], a[c]
        top = a[c]
        det *= best
        for r in range(n):
            if r != c:
                row = a[r]
                f = row[c] / top[c]
                for k in range(c, n + 1):
                    row[k] -= f * top[k]
    if min_det_ratio and det <= min_det_ratio * diag:
        return None
    return [a[i][n] / a[i][i] for i in range(n)]


class OnlineStepCost:
    """``T = a + b_p x prefill tokens + b_d x decode rows + e x [after a proposal]``
    fitted online (weighted least squares, old steps fading, a touch of ridge so that a
    load without prefill still fits) from the step times the engine core measures on its
    own clock. ``e`` is what a proposal costs the next forward (a draft model's forwards
    leave its own weights in the caches, not the target's): without it, at batch 1 the
    steps with drafts, all right after a proposal, against the steps without, mostly not,
    put that cost on the decode rows (the trained draft on a 2-core Zen 3: 0.5-1.1 ms a
    row fitted where a row cost ~0.2 ms and a step after a proposal ~0.5 ms more), and a
    long draft looked as dear as that many short ones. Fitted only while both kinds of
    step are seen (``MIN_SHARE``); else 0, and the intercept holds it."""

    RESOLVE_EVERY = 8
    MIN_SHARE = 0.02  # of the (decayed) steps after a proposal, and of those not

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self._m = [[0.0] * 4 for _ in range(4)]
        self._v = [0.0] * 4
        self._totals: set[int] = set()  # distinct step sizes seen (two make a slope)
        # The last solution, kept while steps of the same shape repeat, for at most
        # RESOLVE_EVERY of them (they move the fit slowly; a step of a new shape, such as a
        # probe's, is solved at once). A solve in Python was most of a step's speculative
        # bookkeeping on a small model.
        self._solved: tuple[float, float, float, float] | None = None
        self._since_solve = self.RESOLVE_EVERY
        # Steps of one shape in a row (the common case: a decode batch, step after step)
        # are folded into the normal equations at once, when the shape changes or the fit
        # is read: ``_run_n`` steps of ``_run_shape``, their seconds decayed into
        # ``_run_s``. Exact (the decay is geometric); a repeated step costs a few
        # attribute updates, not the equations' dozen, on every step of a batch.
        self._run_shape: tuple[int, int, int] | None = None
        self._run_n = 0
        self._run_s = 0.0

    def observe(self, num_prefill_tokens: int, num_decode_rows: int, seconds: float,
                after_proposal: bool = False) -> None:
        if not (seconds > 0.0) or num_prefill_tokens + num_decode_rows <= 0:
            return
        shape = (num_prefill_tokens, num_decode_rows, int(after_proposal))
        if shape == self._run_shape:
            self._run_n += 1
            self._run_s = self._run_s * self.decay + seconds
            self._since_solve += 1
            return
        self._fold()
        self._run_shape, self._run_n, self._run_s = shape, 1, seconds
        self._since_solve += self.RESOLVE_EVERY
        if len(self._totals) < 2:
            self._totals.add(num_prefill_tokens + num_decode_rows)

    def _fold(self) -> None:
        """Add the pending run of one shape to the normal equations, decayed: m = sum of
        x x^T, v = sum of x T over x = (1, p, r, q), each older step weighted by the decay
        once more. n steps of one x: m <- m d^n + x x^T (1 + d + ... + d^(n-1)) and
        v <- v d^n + x S, S their seconds decayed as they came."""
        n = self._run_n
        if not n:
            return
        t, self._run_n, self._run_s = self._run_s, 0, 0.0  # (a run may go on after it)
        p, r, q = (float(f) for f in self._run_shape)
        d = self.decay
        dn = d ** n
        g = (1.0 - dn) / (1.0 - d) if d != 1.0 else float(n)
        m, v = self._m, self._v
        # Written out, the symmetric half only: this runs at every change of shape, and
        # loops over the 4 x 4 took twice as long.
        v[0] = v[0] * dn + t
        v[1] = v[1] * dn + p * t
        v[2] = v[2] * dn + r * t
        v[3] = v[3] * dn + q * t
        m0, m1, m2, m3 = m
        m0[0] = m0[0] * dn + g
        m0[1] = m1[0] = m0[1] * dn + p * g
        m0[2] = m2[0] = m0[2] * dn + r * g
        m0[3] = m3[0] = m0[3] * dn + q * g
        m1[1] = m1[1] * dn + p * p * g
        m1[2] = m2[1] = m1[2] * dn + p * r * g
        m1[3] = m3[1] = m1[3] * dn + p * q * g
        m2[2] = m2[2] * dn + r * r * g
        m2[3] = m3[2] = m2[3] * dn + r * q * g
        m3[3] = m3[3] * dn + q * q * g

    def _combined_slope(self, q: bool) -> float | None:
        """Seconds per token of ``T = a + b x (prefill tokens + decode rows) (+ e q)``
        (the run folded in: ``_coefficients`` calls it after ``_fold``): the normal
        equations of the features (1, p + r, q), summed from the fit's own."""
        m, v = self._m, self._v
        w, n, nn = m[0][0], m[0][1] + m[0][2], m[1][1] + 2 * m[1][2] + m[2][2]
        ny = v[1] + v[2]
        if not q:
            det = w * nn - n * n
            if det <= 1e-9 * w * nn:
                return None
            return max((w * ny - n * v[0]) / det, 0.0)
        # 3 x 3 by Cramer's rule (as the 2 x 2 above: a general solve here took 4x as long)
        nq, wq, qq, v0, vq = m[1][3] + m[2][3], m[0][3], m[3][3], v[0], v[3]
        det = w * (nn * qq - nq * nq) - n * (n * qq - nq * wq) + wq * (n * nq - nn * wq)
        if det <= 1e-9 * w * nn * qq:
            return None
        det_b = w * (ny * qq - nq * vq) - v0 * (n * qq - nq * wq) + wq * (n * vq - ny * wq)
        return max(det_b / det, 0.0)

    def coefficients(self, batch: int = 0) -> tuple[float, float, float] | None:
        """(fixed s, s per prefill token, s per decode row), or None until two step sizes
        were seen. The decode row's cost is never taken below the plain per-token slope:
        where decode rows did not vary apart from prefill, the split is not known."""
        full = self._full()
        return None if full is None else full[:3]

    def after_proposal_s(self, batch: int = 0) -> float:
        """Seconds a step right after a proposal costs more (0 until both kinds seen)."""
        full = self._full()
        return 0.0 if full is None else full[3]

    def _full(self) -> tuple[float, float, float, float] | None:
        if self._since_solve >= self.RESOLVE_EVERY or self._solved is None:
            self._solved, self._since_solve = self._coefficients(), 0
        return self._solved

    def _coefficients(self) -> tuple[float, float, float, float] | None:
        if len(self._totals) < 2:
            return None
        self._fold()
        share = self._m[0][3] / self._m[0][0]
        q = self.MIN_SHARE < share < 1.0 - self.MIN_SHARE
        combined = self._combined_slope(q)
        if combined is None:
            return None
        m = [row[:] for row in self._m]
        for i in (1, 2):  # ridge on the slopes only, relative to their scale
            m[i][i] += 1e-6 * m[i][i] + 1e-12
        keep = [0, 1, 2, 3] if q else [0, 1, 2]
        sol = self._solve_kept(m, keep)
        if sol is None:
            return None
        if sol.get(1, 0.0) < 0 or sol.get(2, 0.0) < 0:  # refit without the one gone negative
            keep = [i for i in keep if i != (1 if sol.get(1, 0.0) < 0 else 2)]
            sol = self._solve_kept(m, keep)
            if sol is None:
                return None
        a, bp, bd, e = (sol.get(i, 0.0) for i in range(4))
        return max(a, 0.0), max(bp, 0.0), max(bd, combined), max(e, 0.0)

    def _solve_kept(self, m: list[list[float]], keep: list[int]) -> dict[int, float] | None:
        sol = _solve([[m[i][j] for j in keep] for i in keep], [self._v[i] for i in keep])
        return None if sol is None else dict(zip(keep, sol))

    def step_s(self, num_prefill_tokens: int, num_decode_rows: int,
               batch: int = 0) -> float | None:
        coef = self.coefficients()
        if coef is None:
            return None
        return coef[0] + coef[1] * num_prefill_tokens + coef[2] * num_decode_rows


class BatchStepCost:
    """One ``OnlineStepCost`` per batch size (power-of-two buckets of decoding requests)
    over one for all steps. A CPU or GPU step is not linear across batch sizes (flat
    while weights are read, linear once compute-bound: a roofline's knee), and a draft's
    marginal cost is wanted at this step's size: a fit over every size would price a
    batch-32 draft at the slope it had at batch 1. The overall fit answers until the
    bucket's own can."""

    # A bucket's fit is anchored by a step without drafts at most this many steps old:
    # fitted on steps full of drafts alone, it extrapolates what a step without them
    # costs, and a high intercept there makes drafts look cheap.
    ANCHOR_EVERY = 64
    # And probed by a step with drafts after this many without (doubling while probes
    # keep finding drafts not worth it, up to 64x): fitted on draft-free steps and a few
    # early drafted ones (a new GEMM row count's first call, the verify path's first
    # run), the slope of a decode row stays what those said, drafts look dear, none is
    # verified again and the fit never learns otherwise. A probe is not free (a draft
    # model catches up on every token since it last proposed), hence the backoff.
    PROBE_EVERY = 64
    MAX_PROBE_BACKOFF = 6

    def __init__(self) -> None:
        self.overall = OnlineStepCost()
        self._by_batch: dict[int, OnlineStepCost] = {}
        self._anchor_age: dict[int, int] = {}  # bucket -> steps since a draft-free one
        self._probe_age: dict[int, int] = {}  # bucket -> steps since one with drafts
        self._probe_backoff: dict[int, int] = {}  # bucket -> probes in a row that failed
        self._probe_pending: dict[int, bool] = {}  # bucket -> a probe awaits the verdict

    def observe(self, num_prefill_tokens: int, num_decode_rows: int, seconds: float,
                batch: int = 0, after_proposal: bool = False) -> None:
        self.overall.observe(num_prefill_tokens, num_decode_rows, seconds, after_proposal)
        key = batch.bit_length()
        fit = self._by_batch.get(key)
        if fit is None:
            fit = self._by_batch[key] = OnlineStepCost()
        fit.observe(num_prefill_tokens, num_decode_rows, seconds, after_proposal)
        if num_decode_rows == batch:
            self._anchor_age[key] = 0
            self._probe_age[key] = self._probe_age.get(key, 0) + 1
        else:
            self._probe_age[key] = 0
            if key in self._anchor_age:
                self._anchor_age[key] += 1

    def needs_anchor(self, batch: int) -> bool:
        """Whether this batch size's next step should verify no draft (see above)."""
        age = self._anchor_age.get(batch.bit_length())
        return age is None or age >= self.ANCHOR_EVERY

    def needs_probe(self, batch: int) -> bool:
        """Whether this batch size's next step should verify drafts whatever the rule
        says (see above); only once a draft-free step was seen at this size."""
        key = batch.bit_length()
        backoff = min(self._probe_backoff.get(key, 0), self.MAX_PROBE_BACKOFF)
        return self._probe_age.get(key, 0) >= self.PROBE_EVERY << backoff

    def probe(self, batch: int, rule_drafted: bool) -> bool:
        """Whether to probe this step, given what the benefit rule decided at this size.
        A probe proposes, and the step after it verifies what is on hand (both count as
        the probe); once the probe's step is in the fit, the rule's next decision is its
        verdict: a refusal doubles the wait for the next probe, drafting resets it."""
        key = batch.bit_length()
        if rule_drafted:
            self._probe_backoff[key] = 0
            self._probe_pending.pop(key, None)
            return False
        if self.needs_probe(batch):
            self._probe_pending[key] = True
            return True
        if self._probe_pending.pop(key, False):  # the probe is in the fit: still refused
            self._probe_backoff[key] = self._probe_backoff.get(key, 0) + 1
        return False

    def coefficients(self, batch: int = 0) -> tuple[float, float, float] | None:
        return self._fit_for(batch).coefficients()

    def after_proposal_s(self, batch: int = 0) -> float:
        """What a proposal costs the next step at this batch size (``OnlineStepCost``)."""
        return self._fit_for(batch).after_proposal_s()

    def _fit_for(self, batch: int) -> OnlineStepCost:
        """The bucket's own fit where it has one, else the overall."""
        fit = self._by_batch.get(batch.bit_length())
        return fit if fit is not None and fit.coefficients() is not None else self.overall

    def step_s(self, num_prefill_tokens: int, num_decode_rows: int,
               batch: int = 0) -> float | None:
        coef = self.coefficients(batch)
        if coef is None:
            return None
        return coef[0] + coef[1] * num_prefill_tokens + coef[2] * num_decode_rows


class ProposalCost:
    """Seconds the proposer takes, ``c + a x rounds + b x tokens`` fitted to its last
    steps: ``c`` per proposal (a call that drafts anything: a draft model's first
    forward right after the target's runs on caches the target just used, and catches
    up on the tokens the last step added; a lookup's setup), ``rounds`` the longest
    draft asked for (a draft model runs one forward per draft position), ``tokens`` the
    drafts asked for over all requests. The runner measures the time (an executor may
    read a clock) and reports it as data.

    On the 2-core Zen 4 a trained draft's proposal at batch 1 cost about as much for one
    draft as the next three together: priced per draft, k stopped at 1-2 where k = 4
    ran 1.36x off against 1.07x. ``c`` is known once proposals of two lengths were seen
    (the controller's exploration makes them); until then, or where the fit does not
    hold (a negative term), fewer terms: rounds and tokens, then tokens alone.

    A request's first proposal pays one-time work (a draft model's prefill of its
    prompt, a suffix tree's build) that later ones do not: the fit waits for a few
    steps and leaves out the dearest one per token, so that one spike does not switch
    speculation off for good."""

    WINDOW = 32
    MIN_STEPS = 4
    # Terms tried, best first: (per call, per round, per draft) as indices of the
    # features (1, rounds, tokens).
    _TERMS = ((0, 1, 2), (0, 2), (1, 2), (2,))

    def __init__(self) -> None:
        self._recent: deque[tuple[float, float, float]] = deque(maxlen=self.WINDOW)
        self._solved: tuple[float, float, float] | None = None
        # The last fit that found a cost per call: where the window no longer tells one
        # apart (every proposal of one length), its split, scaled to the window's level.
        self._shape: tuple[float, float, float] | None = None

    def observe(self, rounds: int, tokens: int, seconds: float) -> None:
        if rounds > 0 and tokens > 0 and seconds >= 0.0:
            self._recent.append((float(rounds), float(tokens), seconds))
            self._solved = None

    def coefficients(self) -> tuple[float, float, float]:
        """(seconds per proposal, per round, per draft token); zeros until a few steps
        were seen (proposing looks free until measured). Solved once per observation
        (every step asks)."""
        if self._solved is None:
            self._solved = self._coefficients()
        return self._solved

    def _coefficients(self) -> tuple[float, float, float]:
        obs = list(self._recent)
        if len(obs) < self.MIN_STEPS:
            return 0.0, 0.0, 0.0
        obs.remove(max(obs, key=lambda o: o[2] / o[1]))
        xs = [(1.0, r, t) for r, t, _ in obs]
        ys = [x for _, _, x in obs]
        for terms in self._TERMS:
            m = [[sum(x[i] * x[j] for x in xs) for j in terms] for i in terms]
            v = [sum(x[i] * y for x, y in zip(xs, ys)) for i in terms]
            # Near-collinear features (one batch size: rounds and tokens move together;
            # one length: no slope to see) give no answer here, only noise.
            sol = _solve(m, v, 1e-6 if len(terms) > 1 else 0.0)
            if sol is None or min(sol) < 0.0:
                continue
            out = [0.0, 0.0, 0.0]
            for i, c in zip(terms, sol):
                out[i] = c
            if terms[0] == 0 and out[0] > 0.0:
                self._shape = (out[0], out[1], out[2])
            elif self._shape is not None:
                # One length in the window: priced per draft alone, a proposal's fixed
                # part makes every longer one look dearer than it is, k stays where it
                # is and the window never sees another length (the trained draft at
                # batch 1 on a 2-core Zen 3: 1.7 ms a draft where a steady four-draft
                # proposal cost 0.4 + 1.3 ms a draft; no drafts where k = 4 ran 1.2x).
                c, a, b = self._shape
                scale = sum(ys) / sum(c + a * r + b * t for _, r, t in xs)
                return c * scale, a * scale, b * scale
            return out[0], out[1], out[2]
        return 0.0, 0.0, 0.0


class OutcomeGuard:
    """Speculation's measured outcome per batch size, the check on the benefit rule.

    The rule decides from estimates (acceptance, a step-cost fit, the proposer's fitted
    time); what it must never do is lose. So each power-of-two bucket of decoding
    requests compares, per emitted token, its decode-only steps two ways: **on**, steps
    that verified drafts (the proposer's time included), and **off**, clean steps with
    no drafts and no proposals, in that step or the one before (a proposer's work also
    slows the next forward: a draft model evicts the target's weights from the cache).
    When drafting has run ``need_on`` steps without fresh off steps to compare with, the
    bucket runs an **off trial**: ``TRIAL`` steps with no drafts and no proposals. Then
    the verdict, on the last ~20 drafted steps (decayed) against the last ``TRIAL``
    clean ones (taken within ``FRESH_OFF`` steps): drafts that lose by more than ``Z``
    standard errors of the steps' own spread (or still lose after ``MAX_UNSURE``
    verdicts put off for more drafted steps) switch the bucket off for a cool-off that
    doubles at every loss (its steps are the next verdict's off steps); drafts that pay stay on,
    and the next verdict waits twice as many drafted steps (up to ``MAX_NEED_ON``), so a
    winning proposer pays for few trials (at most one of ``TRIAL`` steps per 256; none
    for a win by ``WIN_MARGIN`` over the last trial, one per ``WON_AGE`` steps), and
    so do the smaller batch sizes (a win at one size vouches for those below it). Steps
    with prefill in them are not compared (their cost is not the drafts')."""

    MIN_ON = 12  # drafted steps before the first verdict
    MAX_NEED_ON = 256  # ... and at most this many between verdicts while drafts pay
    DECAY_ON = 0.95  # per drafted step: a verdict weighs the last ~20 of them
    TRIAL = 3  # clean off steps a verdict compares with
    # ... taken at most this many steps (of any size) before the verdict: this VM's speed
    # drifts 5-10% between minutes, so off steps from another phase of the run (the
    # first steps at a size, the rule's own pause long ago) judged drafts against a
    # different machine; a verdict without fresh ones runs its trial first.
    FRESH_OFF = 64
    COOL_OFF = 256  # steps a bucket stays off after its first loss
    Z = 2.0  # a loss counts once it exceeds this many standard errors of the steps' noise
    MAX_UNSURE = 2  # ... or after this many verdicts put off (then the estimate decides)
    # A verdict without fresh off steps skips its trial when the drafted steps beat the
    # off steps of the last trial that found drafts paying by this factor, that trial at
    # most WON_AGE steps old: the VM's drift (5-10% between minutes) cannot make such a
    # win, and each trial's off steps cost most where drafts pay most (at batch 1 and
    # 0.9 acceptance, 3 steps of 1 token where a drafted step makes 4).
    WIN_MARGIN = 0.6
    WON_AGE = 1024
    MAX_COOL_OFF = 4096

    @dataclass
    class _Bucket:
        on_s: float = 0.0
        on_tokens: float = 0.0
        num_on: int = 0
        off_s: float = 0.0
        off_tokens: float = 0.0
        num_off: int = 0
        need_on: int = 0  # drafted steps before the next verdict
        trial_left: int = 0  # steps of the off trial still to run
        off_step: int = -1  # the guard's step at the latest clean off step
        off_until: int = 0  # step index at which drafting may resume
        cool_off: int = 0
        # Per-step seconds per token, for the verdict's noise: decayed weight, sum and
        # sum of squares over drafted steps, and plain ones over the off steps kept.
        on_w: float = 0.0
        on_x: float = 0.0
        on_x2: float = 0.0
        off_x: float = 0.0
        off_x2: float = 0.0
        num_unsure: int = 0  # verdicts in a row put off as within the noise
        won_off: float = 0.0  # off seconds per token at the last trial drafts won (0: none)
        won_step: int = 0  # ... and the guard's step then

        def clear_on(self) -> None:
            self.on_s = self.on_tokens = self.on_w = self.on_x = self.on_x2 = 0.0
            self.num_on = 0

        def clear_off(self) -> None:
            self.off_s = self.off_tokens = self.off_x = self.off_x2 = 0.0
            self.num_off = 0

    def __init__(self) -> None:
        self._buckets: dict[int, OutcomeGuard._Bucket] = {}
        self.step = 0
        self.num_switched_off = 0  # verdicts against speculation, all buckets
        self.num_trials = 0  # off trials run, all buckets
        self._proposed_before = False  # the previous step ran the proposer

    def allows(self, batch: int) -> bool:
        b = self._buckets.get(batch.bit_length())
        return b is None or (self.step >= b.off_until and b.trial_left == 0)

    def observe(self, batch: int, num_prefill_tokens: int, num_drafts: int,
                num_emitted: int, step_s: float, propose_s: float,
                steady: bool = True) -> None:
        """One step: ``step_s`` without the proposer's ``propose_s``; one that paid
        one-time work (not ``steady``) is counted but not compared."""
        self.step += 1
        proposed_before, self._proposed_before = self._proposed_before, propose_s > 0.0
        if (num_prefill_tokens or batch <= 0 or num_emitted <= 0 or not step_s > 0.0
                or not steady):
            return
        b = self._buckets.get(batch.bit_length())
        if b is None:
            b = self._buckets[batch.bit_length()] = OutcomeGuard._Bucket(need_on=self.MIN_ON)
        if num_drafts:
            d, x = self.DECAY_ON, (step_s + propose_s) / num_emitted
            b.on_s = b.on_s * d + step_s + propose_s
            b.on_tokens = b.on_tokens * d + num_emitted
            b.on_w, b.on_x, b.on_x2 = b.on_w * d + 1.0, b.on_x * d + x, b.on_x2 * d + x * x
            b.num_on += 1
        elif propose_s == 0.0 and not proposed_before:
            # Clean: as the step costs with speculation off. The latest TRIAL of them.
            keep = min(b.num_off, self.TRIAL - 1) / max(b.num_off, 1)
            x = step_s / num_emitted
            b.off_s = b.off_s * keep + step_s
            b.off_tokens = b.off_tokens * keep + num_emitted
            b.off_x, b.off_x2 = b.off_x * keep + x, b.off_x2 * keep + x * x
            b.num_off = min(b.num_off, self.TRIAL - 1) + 1
            b.off_step = self.step
            b.trial_left = max(b.trial_left - 1, 0)
        if b.num_on < b.need_on or b.trial_left:
            return
        on = b.on_s / b.on_tokens  # seconds per token
        if b.num_off and self.step - b.off_step > self.FRESH_OFF:
            b.clear_off()  # stale: from another phase of the run
        off = b.off_s / b.off_tokens if b.num_off >= self.TRIAL else None
        if off is None:  # nothing fresh to compare with: an off trial first,
            if not (b.won_off and self.step - b.won_step <= self.WON_AGE
                    and on < self.WIN_MARGIN * b.won_off):  # unless no drift explains it
                b.trial_left = self.TRIAL - b.num_off
                self.num_trials += 1
                return
            self._drafts_pay(b, batch)
        elif on > off + self.Z * self._noise(b) or (on > off
                                                     and b.num_unsure >= self.MAX_UNSURE):
            b.cool_off = min(2 * b.cool_off, self.MAX_COOL_OFF) or self.COOL_OFF
            b.off_until = self.step + b.cool_off
            b.need_on = self.MIN_ON
            self.num_switched_off += 1
        elif on > off:
            # A loss within the steps' own noise (the first drafted steps at a size are a
            # handful, and a request's drafts do better once its text repeats): more
            # drafted steps before deciding, the drafted ones kept (decaying) and the off
            # ones compared again once fresh. A wrong verdict costs a whole cool-off.
            b.num_unsure += 1
            b.need_on = b.num_on + self.MIN_ON
            return
        else:
            b.won_off, b.won_step = off, self.step
            self._drafts_pay(b, batch)
        b.num_unsure = 0
        b.clear_on()  # and with fresh drafted steps

    def _drafts_pay(self, b: OutcomeGuard._Bucket, batch: int) -> None:
        b.cool_off = 0
        b.need_on = min(2 * b.need_on, self.MAX_NEED_ON)
        b.clear_off()  # the next verdict compares with a fresh trial
        self._vouch_below(batch.bit_length(), b.need_on)

    @staticmethod
    def _noise(b: OutcomeGuard._Bucket) -> float:
        """Standard error of (on - off) seconds per token, from the steps' own spread."""
        var_on = max(b.on_x2 / b.on_w - (b.on_x / b.on_w) ** 2, 0.0)
        n_off = min(b.num_off, OutcomeGuard.TRIAL)
        var_off = max(b.off_x2 / n_off - (b.off_x / n_off) ** 2, 0.0)
        return (var_on / b.on_w + var_off / n_off) ** 0.5

    def _vouch_below(self, key: int, need_on: int) -> None:
        """Drafts that pay at this batch size pay at every smaller one (a smaller step is
        more of its fixed cost, and what a draft saves is a step): the smaller sizes'
        next verdicts wait as long as this one's. Each size still has its own verdicts,
        but the tail of a batch (its last requests finishing one by one, a few steps at
        each size) no longer pays an off trial at every size it passes through."""
        for k in range(1, key):
            lower = self._buckets.get(k)
            if lower is None:
                self._buckets[k] = OutcomeGuard._Bucket(need_on=need_on)
            elif lower.off_until <= self.step and not lower.trial_left:
                lower.need_on = max(lower.need_on, need_on)


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
    # acceptance moved, and the step-cost fit moves slowly. On a model whose step is
    # ~1 ms the full plan is 1-2% of a step (benchmarks/spec_decode.py's small target).
    # Each further plan in a row at that size that drafts nothing doubles the reuse, up
    # to MAX_DORMANT_DOUBLINGS times (the rule's probes wait for a plan: at most
    # DORMANT_STEPS << MAX_DORMANT_DOUBLINGS steps late).
    DORMANT_STEPS = 8
    MAX_DORMANT_DOUBLINGS = 3
    # A slot is taken only if it is worth this many times its cost: one that barely pays
    # gains next to nothing, and what the cost model leaves out (a drafted step's verify
    # work, the fit's noise) makes it lose. Synthetic acceptance 0.6 at batch 32 priced a
    # first draft at 0.071 ms of value against 0.068 of cost; drafting there ran 0.86x
    # off (k = 4: 0.84x) until the outcome guard switched it off, again after each
    # cool-off.
    BENEFIT_MARGIN = 1.2
    # Whether a plan prices drafts against the whole step, prefill chunks included (the
    # rule before 76e406a; kept for in-process A/Bs): see ``_plan_by_benefit``.
    PRICE_PREFILL = False

    def __init__(self, config: SpeculativeConfig, cost: StepCost | None) -> None:
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
        # Whether a request's own record fades while it does not draft (_REQUEST_DECAY's
        # note). Not for a draft model: a request that resumes drafting pays a catch-up
        # on the text since, which no fit prices (at batch 16, 0.92x and 0.95x off with
        # the fade against 1.00x and 0.99x without in two in-process A/Bs, drafting
        # 0.08 a token; the engines were built in one order, so part of it may be where
        # they landed).
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
        later one starts unmeasured, and priced at 1 in 2 it stayed untried (the trained
        draft at batch 1 on a 2-core Zen 3: draft 4 sat at 0.50 for whole runs while
        drafts 1-3 read 0.80-0.95, and the plan stopped at k = 3)."""
        out, before = [], 0.5
        for acc, tried in zip(self._glob_acc, self._glob_try):
            before = (acc + before) / (tried + 1.0) if out else acc / tried
            out.append(before)
        return out

    def acceptance(self, req: Request, prior: list[float] | None = None) -> list[float]:
        """Estimated P(draft j survives | drafts before it did), j = 1..k."""
        own = _own_counts(req, self.fade_idle)
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

    def observe(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """Fold in one verification: ``num_accepted`` leading drafts of ``num_drafts``."""
        if num_drafts <= 0:
            return
        m = self.metrics
        m.num_draft_tokens += num_drafts
        m.num_accepted_tokens += num_accepted
        m.num_verify_steps += 1
        own = _own_counts(req, self.fade_idle)
        if own is None:
            k = self.config.num_speculative_tokens
            own = [[0.0, 0.0] for _ in range(k)]
        req.spec_acceptance = own
        # (This step emits num_accepted + 1 tokens, appended after this call.)
        req.spec_seen_at = req.num_output_tokens + num_accepted + 1
        for pos in range(len(own)):
            own[pos][0] *= _REQUEST_DECAY
            own[pos][1] *= _REQUEST_DECAY
        req.spec_first_tries += 1
        req.spec_first_hits += num_accepted > 0
        # Positions up to the first rejection were tried; the ones after it were not.
        for j in range(min(num_drafts, num_accepted + 1)):
            ok = 1.0 if j < num_accepted else 0.0
            own[j][0] += ok
            own[j][1] += 1.0
            self._glob_acc[j] = self._glob_acc[j] * _GLOBAL_DECAY + ok
            self._glob_try[j] = self._glob_try[j] * _GLOBAL_DECAY + 1.0
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
        one's (drafts that do not pay at a size pay at no larger one; at batch 4 a draft
        model's catch-up on four whole prompts for drafts the next plan refused was 2.5%
        of the run), and ``num_speculative_tokens`` before any plan."""
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
            # Recorded as "none" (k_want_for, dormancy), it made the next request start
            # without drafts: at batch 1 on the trained pair, every request that ended on
            # a step of its own sent the next into a run of dormant plans, 1.03x off
            # where k = 4 ran 1.71x.
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
    # step against the draft-free ones, whose time varies by ~0.5 ms on this VM at batch
    # 4 (1.4 ms). One request's 4 drafts priced a row at 0.25 ms where it cost 0.07, the
    # rule refused, the probes backed off and suffix drafting (1.2x there) stayed off
    # for the run; 16 rows put such noise at 0.03 ms a row. Every probed request of a
    # draft model pays a catch-up: at most PROBE_DRAFT_MODEL_ROWS of them, each to its
    # cap. (They proposed one draft each while a further draft cost a forward in Python:
    # 4 rows over a step that varies by ~0.5 ms priced a verify row at 0.17-0.47 ms
    # where one cost ~0.05, at batch 4 on a 2-core Zen 5, and the draft model drafted
    # 0.2-0.6 a token, 0.96-1.01x off where k = 4 ran 1.23-1.29x. A further draft now
    # costs ~0.07 ms: draft_forward.c.)
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
    # 128-token prompt (2.9 ms on a 2-core Zen 5) against a 1.3 ms step never paid,
    # grew while the request waited, and the trained draft at batch 1 drafted 0.12 a
    # token (0.99x off) where k = 4 ran 1.42x.
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
        # cheap (a step of 8 decodes and 1,024 prefill tokens yields 8 tokens in ~100
        # ms), so such a step drafted for requests that then caught up on whole prompts,
        # for drafts verified in the decode-only steps after it, where they did not pay
        # (batch 16 on the trained pair: 20 ms of catch-ups a round, 1.3% of it).
        if not self.PRICE_PREFILL:
            num_prefill = 0
        coefficients = getattr(cost, "coefficients", None)
        if coefficients is not None:  # one solve for both (the fit is linear)
            coef = coefficients(batch)
            if coef is None:
                return  # no cost known yet (two step sizes teach it): no drafts
            t0 = coef[0] + coef[1] * num_prefill + coef[2] * num_decode
            slope = coef[2]
        else:
            t0 = cost.step_s(num_prefill, num_decode, batch) if cost is not None else None
            t1 = cost.step_s(num_prefill, num_decode + 1, batch) if t0 is not None else None
            if t0 is None or t1 is None:
                return  # no cost known yet (two step sizes teach it): no drafts
            slope = max(t1 - t0, 0.0)
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
        best = max((p0 if (own := _own_counts(r.request, self.fade_idle)) is None
                    else (own[0][0] + w * p0) / (own[0][1] + w)) for r in rows)
        slots = sum(r.cap for r in rows)
        # (A draft model's request that starts drafting catches up first, on the text
        # since it last proposed: a forward's worth that the fit of steady proposals does
        # not see. Its first draft is bounded by a round of its own, as before the
        # per-call term: amortized, single drafts got through at batch 64 and paid
        # catch-ups, 0.13 drafts a token and 0.91x off in one grid; a round each: none,
        # 0.99x.)
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
