"""The step-cost fit speculative decoding prices drafts with: fitted online to the step
times the scheduler sees (``OnlineStepCost``), one fit per batch size
(``BatchStepCost``), with the anchors and probes that keep it honest.

A fit is a ``StepCostModel`` (``conveyor.costs``) whose linear ``coefficients`` the
planner reads directly (one solve for a whole plan). No torch and no clock: step times
come in as numbers.
"""

from __future__ import annotations

import math

from conveyor.costs.shape import BatchShape


def solve(m: list[list[float]], v: list[float],
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
    put that cost on the decode rows (fitted several times what a row costs), and a
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
        # loops over the 4 x 4 cost more.
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
        # 3 x 3 by Cramer's rule (as the 2 x 2 above: cheaper than a general solve)
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
        sol = solve([[m[i][j] for j in keep] for i in keep], [self._v[i] for i in keep])
        return None if sol is None else dict(zip(keep, sol))

    def step_s(self, num_prefill_tokens: int, num_decode_rows: int,
               batch: int = 0) -> float | None:
        """Predicted seconds of a step (None until two step sizes were seen). Prefill
        tokens and decode rows apart: a decode row (a draft is one) also carries per-row
        work that a batched prompt token does not (its attention over the cache)."""
        coef = self.coefficients()
        if coef is None:
            return None
        return coef[0] + coef[1] * num_prefill_tokens + coef[2] * num_decode_rows

    def step_time(self, shape: BatchShape) -> float:
        """``StepCostModel``'s question (NaN until two step sizes were seen)."""
        s = self.step_s(shape.num_prefill_tokens, shape.num_decodes)
        return math.nan if s is None else s


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
        """``OnlineStepCost.step_s`` by the fit of ``batch`` decoding requests."""
        coef = self.coefficients(batch)
        if coef is None:
            return None
        return coef[0] + coef[1] * num_prefill_tokens + coef[2] * num_decode_rows

    def step_time(self, shape: BatchShape) -> float:
        """``StepCostModel``'s question, its decode rows taken as the batch size (NaN
        until two step sizes were seen)."""
        s = self.step_s(shape.num_prefill_tokens, shape.num_decodes, shape.num_decodes)
        return math.nan if s is None else s
