"""Verification of draft tokens: greedy is exact, sampling keeps the target distribution.

The statistical tests run many independent copies of one verification in a single
batch and bound the total variation distance between the empirical and the exact
distribution by what the sample size allows (E[TVD] <= sqrt(V/N)/2, plus a McDiarmid
deviation at 1e-9), so a correct verifier passes and a wrong bonus or recovery
distribution (which moves probability by >= 0.1 here) fails.
"""

from __future__ import annotations

import math

import pytest
import torch

from conveyor.runner import verify as verify_mod
from conveyor.runner.sampler import Sampler, SamplingRow
from conveyor.runner.verify import VerifyGroup, verify
from conveyor.sampling_params import SamplingParams

V = 6
# Three distinct target rows (positions 0, 1, 2 of one request).
LOGITS = torch.tensor([[1.0, 0.2, -0.5, 0.8, 0.0, -1.0],
                       [0.1, 1.2, 0.3, -0.2, 0.9, -0.4],
                       [-0.3, 0.0, 1.1, 0.4, -0.8, 0.6]])


def tvd_bound(n: int, vocab: int = V, delta: float = 1e-9) -> float:
    return 0.5 * math.sqrt(vocab / n) + math.sqrt(math.log(1 / delta) / (2 * n))


def tvd(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def target_probs(params: SamplingParams, rows: torch.Tensor = LOGITS) -> torch.Tensor:
    """The exact distribution, computed here from the definitions (not the sampler)."""
    z = rows / params.temperature
    if params.top_k:
        kth = z.topk(params.top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    return torch.softmax(z, dim=-1)


def run_many(params: SamplingParams, drafts: list[int], n: int, seed: int = 0,
             draft_probs: torch.Tensor | None = None, sample_drafts: bool = False):
    """n copies of one request verifying ``drafts`` (rows LOGITS[:k+1]); returns tokens."""
    k = len(drafts)
    gen = torch.Generator().manual_seed(seed + 1)
    groups = []
    for _ in range(n):
        d = drafts
        if sample_drafts:  # drafts drawn from q, as a draft model does
            d = [int(torch.multinomial(draft_probs[j], 1, generator=gen)) for j in range(k)]
        rows = [SamplingRow(params, [0], [0] * j) for j in range(k + 1)]
        groups.append(VerifyGroup(rows, d, draft_probs))
    logits = LOGITS[:k + 1].repeat(n, 1)
    return verify(Sampler(V, torch.device("cpu"), seed=seed), logits, groups).token_ids


def first_tokens(outs, drafts_prefix: list[int]) -> torch.Tensor:
    """Counts of the token after ``drafts_prefix`` among outputs that begin with it."""
    j = len(drafts_prefix)
    counts = torch.zeros(V)
    for toks in outs:
        if toks[:j] == drafts_prefix and len(toks) > j:
            counts[toks[j]] += 1
    return counts


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.6, top_k=4)],
                         ids=["t1", "t0.6-topk4"])
def test_one_hot_drafts_keep_the_target_distribution(params):
    n = 20000
    drafts = [3, 4]  # plausible but not the argmax at position 0
    outs = run_many(params, drafts, n)
    p = target_probs(params)
    bound = tvd_bound(n)
    # Position 0: every output's first token follows p0 (accepted draft or recovery).
    assert tvd(first_tokens(outs, []), p[0]) < bound
    # Given draft 0 survived, the next token follows p1; given both did, the bonus p2.
    c1 = first_tokens(outs, drafts[:1])
    assert c1.sum() > 2000 and tvd(c1, p[1]) < tvd_bound(int(c1.sum()))
    c2 = first_tokens(outs, drafts)
    assert c2.sum() > 500 and tvd(c2, p[2]) < tvd_bound(int(c2.sum()))
    assert all(1 <= len(t) <= 3 for t in outs)


def test_drafts_sampled_from_q_keep_the_target_distribution():
    n = 20000
    params = SamplingParams(temperature=1.0)
    q = torch.softmax(torch.tensor([[0.0, 1.0, 0.5, 0.0, -1.0, 0.3],
                                    [0.7, 0.0, 0.0, 0.2, 0.1, -0.5]]), dim=-1)
    outs = run_many(params, [0, 0], n, draft_probs=q, sample_drafts=True)
    p = target_probs(params)
    assert tvd(first_tokens(outs, []), p[0]) < tvd_bound(n)


def test_the_bound_catches_a_wrong_recovery_distribution(monkeypatch):
    """The same test against a verifier that recovers from p itself (without removing
    the rejected draft): the draft token is then over-produced and the bound fails."""
    monkeypatch.setattr(verify_mod, "_residual", lambda p, g, j: p)
    n = 20000
    params = SamplingParams(temperature=1.0)
    outs = run_many(params, [3, 4], n)
    assert tvd(first_tokens(outs, []), target_probs(params)[0]) > tvd_bound(n)


def test_the_bound_catches_a_bonus_token_from_the_wrong_row(monkeypatch):
    """A verifier whose bonus token comes from the last draft's row, not the row after."""
    real = verify_mod.verify

    def wrong_bonus(sampler, logits, groups, synthetic_rate=None):
        logits = logits.clone()
        pos = 0
        for g in groups:
            k = len(g.drafts)
            logits[pos + k] = logits[pos + k - 1]
            pos += k + 1
        return real(sampler, logits, groups, synthetic_rate)

    n = 20000
    params = SamplingParams(temperature=1.0)
    outs = wrong_bonus(Sampler(V, torch.device("cpu")), LOGITS[:3].repeat(n, 1),
                       [VerifyGroup([SamplingRow(params, [0], [0] * j) for j in range(3)],
                                    [3, 4]) for _ in range(n)]).token_ids
    c2 = first_tokens(outs, [3, 4])
    assert tvd(c2, target_probs(params)[2]) > tvd_bound(int(c2.sum()))


def test_greedy_accepts_the_prefix_that_matches_the_argmax():
    greedy = SamplingParams(temperature=0.0)
    argmax = LOGITS.argmax(dim=-1).tolist()  # [0, 1, 2]
    sampler = Sampler(V, torch.device("cpu"))

    def run(drafts):
        rows = [SamplingRow(greedy, [0], [0] * j) for j in range(len(drafts) + 1)]
        return verify(sampler, LOGITS[:len(drafts) + 1],
                      [VerifyGroup(rows, drafts)]).token_ids[0]

    assert run([argmax[0], argmax[1]]) == argmax  # all accepted + bonus
    assert run([argmax[0], 5]) == [argmax[0], argmax[1]]  # second rejected: corrected
    assert run([4, argmax[1]]) == [argmax[0]]  # first rejected
    assert run([]) == [argmax[0]]


def test_penalties_count_the_drafts_before_each_row():
    """With a strong repetition penalty, a draft repeated at the next position is judged
    by the penalized row (the draft itself counts as generated)."""
    params = SamplingParams(temperature=0.0, repetition_penalty=100.0)
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0, 0.0, 0.0],
                           [0.0, 5.0, 1.0, 0.0, 0.0, 0.0]])
    rows = [SamplingRow(params, [0], []), SamplingRow(params, [0], [1])]
    out = verify(Sampler(V, torch.device("cpu")), logits, [VerifyGroup(rows, [1])])
    # Row 0 picks 1 (accepted); row 1 has 1 penalized (5/100 < 1), so it picks 2.
    assert out.token_ids == [[1, 2]]


def test_seeded_rows_do_not_depend_on_the_batch():
    params = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=1.0)

    def group(p, drafts):
        return VerifyGroup([SamplingRow(p, [0], [7] * j) for j in range(len(drafts) + 1)],
                           drafts)

    alone = verify(Sampler(V, torch.device("cpu"), seed=1), LOGITS[:3],
                   [group(params, [3, 4])]).token_ids[0]
    for seed in range(5):
        logits = torch.cat([LOGITS[:2], LOGITS[:3], LOGITS[:1]])
        mixed = verify(Sampler(V, torch.device("cpu"), seed=seed), logits,
                       [group(other, [3]), group(params, [3, 4]), group(other, [])])
        assert mixed.token_ids[1] == alone


def test_synthetic_acceptance_follows_its_rate():
    n, k, rate = 4000, 3, 0.6
    params = SamplingParams(temperature=0.0)
    groups = [VerifyGroup([SamplingRow(params, [0], [0] * j) for j in range(k + 1)],
                          [5, 5, 5]) for _ in range(n)]
    logits = torch.cat([LOGITS, LOGITS[:1]]).repeat(n, 1)
    outs = verify(Sampler(V, torch.device("cpu")), logits, groups, synthetic_rate=rate)
    accepted = [len(t) - 1 for t in outs.token_ids]
    first = sum(a >= 1 for a in accepted) / n
    second = sum(a >= 2 for a in accepted) / max(sum(a >= 1 for a in accepted), 1)
    assert abs(first - rate) < 0.05 and abs(second - rate) < 0.05
