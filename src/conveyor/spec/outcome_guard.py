"""The check on the draft-length rule: speculation's measured outcome per batch size."""

from __future__ import annotations

from dataclasses import dataclass


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
    # ... taken at most this many steps (of any size) before the verdict: a shared
    # machine's speed drifts between minutes, so off steps from another phase of the run (the
    # first steps at a size, the rule's own pause long ago) judged drafts against a
    # different machine; a verdict without fresh ones runs its trial first.
    FRESH_OFF = 64
    COOL_OFF = 256  # steps a bucket stays off after its first loss
    Z = 2.0  # a loss counts once it exceeds this many standard errors of the steps' noise
    MAX_UNSURE = 2  # ... or after this many verdicts put off (then the estimate decides)
    # A verdict without fresh off steps skips its trial when the drafted steps beat the
    # off steps of the last trial that found drafts paying by this factor, that trial at
    # most WON_AGE steps old: a machine's drift cannot make such a win, and each
    # trial's off steps cost most where drafts pay most (a step of one token each where
    # a drafted step makes several).
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
