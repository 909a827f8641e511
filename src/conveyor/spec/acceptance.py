"""Acceptance estimates: how likely each draft position survives verification.

Tracked online per position (the probability that draft ``j`` survives given drafts
``1..j-1`` did), per request (its own decayed counts, ``Request.spec_acceptance``) and
per proposer (``DraftLengthController``'s prior), counted the honest way: up to the
first rejection. ``PriorWeight`` says how much the proposer-wide estimate weighs in a
request's own.
"""

from __future__ import annotations

from conveyor.request import Request

# How fast a request's old observations fade (per observation), and the proposer-wide
# estimate's (per draft position tried).
REQUEST_DECAY = 0.9
GLOBAL_DECAY = 0.995
# A request's own counts also fade by REQUEST_DECAY per output token it emitted without
# verifying drafts (``DraftLengthController.fade_idle``): acceptance runs in stretches of
# the text (a loop the drafts follow, then code they cannot guess), and what failed a
# stretch ago says less about the text now. Without it a request whose estimate fell in
# one bad stretch stays below the rule's bar (nothing verified, nothing moves it) until
# a probe.


def own_counts(req: Request, fade: bool = True,
               num_output: int | None = None) -> list[list[float]] | None:
    """The request's [accepted, tried] per position, faded by the tokens since (up to
    ``num_output`` output tokens; None: all it has)."""
    own = req.spec_acceptance
    if own is None or not fade:
        return own
    if num_output is None:
        num_output = req.num_output_tokens
    idle = num_output - req.spec_seen_at
    if idle <= 0:
        return own
    f = REQUEST_DECAY ** idle
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
    request's drafts for good. (With a small fixed ``w``, one early rejection takes a
    good draft model's estimate below the rule's bar, and with nothing verified nothing
    moves it back.) ``LOW`` until ``MIN_REQUESTS`` requests of ``MIN_TRIES`` tries
    finished (a larger weight there pulls a request in a good stretch down to the
    proposer's mean)."""

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
