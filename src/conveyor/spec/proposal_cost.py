"""What the proposer costs: ``ProposalCost``, fitted to its measured times."""

from __future__ import annotations

from collections import deque

from conveyor.spec.step_cost_fit import solve


class ProposalCost:
    """Seconds the proposer takes, ``c + a x rounds + b x tokens`` fitted to its last
    steps: ``c`` per proposal (a call that drafts anything: a draft model's first
    forward right after the target's runs on caches the target just used, and catches
    up on the tokens the last step added; a lookup's setup), ``rounds`` the longest
    draft asked for (a draft model runs one forward per draft position), ``tokens`` the
    drafts asked for over all requests. The runner measures the time (an executor may
    read a clock) and reports it as data.

    A draft model's first draft can cost as much as the next few together: priced per
    draft, the plan stops short of the length that pays. ``c`` is known once proposals
    of two lengths were seen (the controller's exploration makes them); until then, or
    where the fit does not hold (a negative term), fewer terms: rounds and tokens, then
    tokens alone.

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
            sol = solve(m, v, 1e-6 if len(terms) > 1 else 0.0)
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
                # is and the window never sees another length.
                c, a, b = self._shape
                scale = sum(ys) / sum(c + a * r + b * t for _, r, t in xs)
                return c * scale, a * scale, b * scale
            return out[0], out[1], out[2]
        return 0.0, 0.0, 0.0
