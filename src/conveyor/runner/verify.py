"""Verification of draft tokens against the target model, one vectorized pass (CPU, GPU).

A request verifying ``k`` drafts owns ``k + 1`` consecutive logit rows: row ``j``
holds the target's distribution for the position of draft ``j`` (row ``k``: the one
after the last draft). Rows are processed exactly as the sampler processes a normal
row (penalties counting the drafts before it, min_tokens, temperature, top-k, top-p,
min-p), so that:

* greedy: drafts are accepted while each equals the target's argmax; the target's
  argmax at the first mismatch (or after the last draft) follows. Identical tokens to
  decoding without speculation.
* random (Leviathan et al. 2023, Chen et al. 2023): draft ``d`` with proposal
  probability ``q(d)`` is accepted with probability ``min(1, p(d) / q(d))``; at the
  first rejection a token is drawn from ``norm(max(p - q, 0))``; when every draft
  survives a bonus token is drawn from ``p``. The output then follows ``p`` exactly.
  A proposer without a distribution (n-gram, suffix, a greedy draft) is a one-hot
  ``q``: accept with probability ``p(d)``, recover from ``p`` with ``d`` removed.
* seeded random rows (coupled): the target's token at each position is the one the
  sampler would draw there without speculation (``argmax(p / E)``, its exponential race
  with the noise ``E`` of (seed, output position)); a draft is accepted iff it equals
  that token, and the first token that differs is that token. A seeded request's output
  is then exactly its output without speculation, whatever the proposer, the draft
  length or the batch. A proposer with a distribution draws its drafts with the same
  noise (``argmax(q / E)``: the Gumbel coupling), so a draft close to the target is
  accepted about as often as under the rule above.
* synthetic (benchmarks): each draft survives with a fixed probability, whatever the
  target says; not lossless, for sweeping acceptance without a trained drafter.

Seeded rows draw from (seed, output position) alone, so they do not depend on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.runner.sampler import Sampler, SamplingRow


@dataclass
class VerifyGroup:
    """One request's rows: ``rows[j]`` samples the token after ``drafts[:j]``."""

    rows: list[SamplingRow]  # len(drafts) + 1
    drafts: list[int]
    # [len(drafts), V] proposal probabilities, or None: one-hot (a proposer's argmax).
    draft_probs: torch.Tensor | None = None


@dataclass
class VerifyResult:
    token_ids: list[list[int]]  # per group: accepted drafts, then the target's token
    logprobs: list[list[tuple[list[int], list[float], int, float]] | None]


def verify(sampler: Sampler, logits: torch.Tensor, groups: list[VerifyGroup],
           synthetic_rate: float | None = None) -> VerifyResult:
    """``logits``: [sum(len(g.rows)), V], the groups' rows in order."""
    rows = [r for g in groups for r in g.rows]
    assert logits.shape[0] == len(rows), (logits.shape, len(rows))
    logits, raw = sampler.process(logits, rows)
    params = [r.params for r in rows]
    greedy = [p.greedy for p in params]
    argmax = logits.argmax(dim=-1)
    random_rows = not all(greedy)
    # Seeded random rows verify by coupling (see above), unless acceptance is synthetic.
    coupled_rows = [synthetic_rate is None and not g and r.params.seed is not None
                    for g, r in zip(greedy, rows)]
    probs = None
    if random_rows:
        # As the sampler leaves them (the coupled race uses these: the very same numbers
        # as sampling without speculation), and normalized (min-p leaves rows unnormalized).
        raw_probs = sampler.probs(logits, params, greedy)
        probs = raw_probs / raw_probs.sum(dim=-1, keepdim=True)

    # Row index of each draft, and the draft checked there.
    starts, pos = [], 0
    for g in groups:
        starts.append(pos)
        pos += len(g.rows)
    draft_rows = [s + j for s, g in zip(starts, groups) for j in range(len(g.drafts))]
    draft_toks = [d for g in groups for d in g.drafts]
    accept: list[bool] = []
    # Rows all greedy: every comparison in Python on one host copy of the argmaxes (a
    # handful of small torch ops per step was most of a verification on a small model).
    am = None if random_rows else argmax.tolist()
    if draft_rows and synthetic_rate is not None:  # whatever the target says
        accept = (sampler.uniform([rows[i] for i in draft_rows]) < synthetic_rate).tolist()
    elif draft_rows and am is not None:
        accept = [am[i] == t for i, t in zip(draft_rows, draft_toks)]
    elif draft_rows:  # some rows random: greedy ones by argmax, the others by p/q
        idx = torch.tensor(draft_rows, device=logits.device)
        toks = torch.tensor(draft_toks, device=logits.device)
        u = sampler.uniform([rows[i] for i in draft_rows])
        ok = argmax[idx] == toks
        p_d = probs[idx, toks]
        q_d = _draft_q(groups, toks)
        rand_ok = u * q_d < p_d  # u < min(1, p/q)
        is_greedy = torch.tensor([greedy[i] for i in draft_rows], device=ok.device)
        ok = torch.where(is_greedy, ok, rand_ok)
        coupled = [j for j, i in enumerate(draft_rows) if coupled_rows[i]]
        if coupled:
            # Accepted iff the draft is the token the sampler draws there.
            cidx = idx[coupled]
            crows = [rows[draft_rows[j]] for j in coupled]
            cp = raw_probs[cidx]
            race = (cp / sampler.noise(crows, [False] * len(crows), cp)).argmax(dim=-1)
            ok[coupled] = race == toks[coupled]
        accept = ok.tolist()

    # Leading accepts per group; the row after them yields the target's token.
    num_accepted, final_rows, rejected_at = [], [], []
    cursor = 0
    for s, g in zip(starts, groups):
        k = len(g.drafts)
        a = 0
        while a < k and accept[cursor + a]:
            a += 1
        cursor += k
        num_accepted.append(a)
        final_rows.append(s + a)
        rejected_at.append(a < k)

    if am is not None:
        final_ids = [am[i] for i in final_rows]
    else:
        fidx = torch.tensor(final_rows, device=logits.device)
        final = argmax[fidx]
        fp = probs[fidx].clone()
        if synthetic_rate is None:
            for i, (g, a, rej) in enumerate(zip(groups, num_accepted, rejected_at)):
                f = final_rows[i]
                if coupled_rows[f]:
                    fp[i] = raw_probs[f]  # the sampler's own draw at this position
                elif rej and not greedy[f]:
                    fp[i] = _residual(fp[i], g, a)
        frows = [rows[i] for i in final_rows]
        fgreedy = [greedy[i] for i in final_rows]
        sampled = (fp / sampler.noise(frows, fgreedy, fp)).argmax(dim=-1)
        is_greedy = torch.tensor(fgreedy, device=logits.device)
        final_ids = torch.where(is_greedy, final, sampled).tolist()

    tokens = [g.drafts[:a] + [t] for g, a, t in zip(groups, num_accepted, final_ids)]
    logprobs: list = []
    for s, g, toks_g in zip(starts, groups, tokens):
        if g.rows[0].params.logprobs is None:
            logprobs.append(None)
            continue
        logprobs.append([sampler.logprob_of(raw[s + j], t, g.rows[0].params)
                         for j, t in enumerate(toks_g)])
    return VerifyResult(tokens, logprobs)


def _draft_q(groups: list[VerifyGroup], toks: torch.Tensor) -> torch.Tensor:
    """q(draft) per draft row: 1 for one-hot proposals, else the proposer's probability."""
    qs = []
    for g in groups:
        if not g.drafts:
            continue
        if g.draft_probs is None:
            qs.append(torch.ones(len(g.drafts), device=toks.device))
        else:
            d = torch.tensor(g.drafts, device=toks.device)
            qs.append(g.draft_probs.float()[torch.arange(len(g.drafts)), d])
    return torch.cat(qs)


def _residual(p: torch.Tensor, g: VerifyGroup, j: int) -> torch.Tensor:
    """norm(max(p - q, 0)) at the first rejected draft ``j`` (left unnormalized: the race
    does not need it). If it is empty (p == q), p itself."""
    if g.draft_probs is None:
        res = p.clone()
        res[g.drafts[j]] = 0.0
    else:
        res = torch.clamp(p - g.draft_probs[j].float(), min=0.0)
    return res if bool(res.sum() > 0) else p
