"""The sampler's batched device path (runner/device_sampling.py) equals the per-row loops
it replaced, bit for bit: penalties, min_tokens' blocked stops, logprobs, and whole
sampler calls (greedy, random, seeded) with the same generator state."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from conveyor.runner import device_sampling
from conveyor.runner.sampler import Sampler, SamplingRow
from conveyor.sampling_params import SamplingParams

V = 300


def _rows(n: int, seed: int) -> list[SamplingRow]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        kind = i % 4
        p = SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.0, 1.3]),
            top_k=rng.choice([0, 5, 50]), top_p=rng.choice([1.0, 0.9, 0.5]),
            min_p=rng.choice([0.0, 0.05]),
            repetition_penalty=1.0 if kind == 0 else rng.choice([1.0, 1.2, 0.8]),
            frequency_penalty=0.0 if kind == 1 else rng.choice([0.0, 0.5, -0.3]),
            presence_penalty=0.0 if kind == 2 else rng.choice([0.0, 0.4, 1.1]),
            min_tokens=rng.choice([0, 3, 8]), stop_token_ids=rng.sample(range(V), 2),
            ignore_eos=rng.random() < 0.5, logprobs=rng.choice([None, 0, 1, 5]),
            seed=rng.choice([None, 11, 12345]), max_tokens=16)
        p.eos_token_ids = frozenset({2, 7})
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 30))]
        outs = [rng.randrange(V) for _ in range(rng.randint(0, 12))]
        rows.append(SamplingRow(p, prompt, outs))
    return rows


def _logits(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * 4


@pytest.mark.parametrize("seed", range(6))
def test_batched_penalties_and_stops_equal_the_per_row_loops(seed) -> None:
    sampler = Sampler(V, torch.device("cpu"))
    rows, logits = _rows(17, seed), _logits(17, seed)
    assert torch.equal(sampler._apply_penalties(logits, rows),
                       sampler._apply_penalties_per_row(logits, rows))
    assert torch.equal(sampler._block_stops(logits, rows),
                       sampler._block_stops_per_row(logits, rows))


@pytest.mark.parametrize("seed", range(4))
def test_one_copy_results_equal_the_per_row_logprobs(seed) -> None:
    rows, logits = _rows(13, seed), _logits(13, seed)
    params = [r.params for r in rows]
    raw = torch.log_softmax(logits, dim=-1)
    tokens = torch.multinomial(raw.exp(), 1, generator=torch.Generator().manual_seed(seed))[:, 0]
    got_tokens, got = device_sampling.results(tokens, raw, params)
    assert got_tokens == tokens.tolist()
    assert got == Sampler._logprobs(raw, tokens.tolist(), params)
    assert device_sampling.results(tokens, None, params) == (tokens.tolist(), [None] * 13)


def _per_row_sampler(seed: int) -> Sampler:
    """Today's sampler before the batched path: its per-row loops swapped back in."""
    s = Sampler(V, torch.device("cpu"), seed=seed)
    s._apply_penalties = s._apply_penalties_per_row
    s._block_stops = s._block_stops_per_row
    return s


@pytest.mark.parametrize("seed", range(4))
def test_sampler_calls_equal_the_per_row_sampler(seed) -> None:
    new, old = Sampler(V, torch.device("cpu"), seed=seed), _per_row_sampler(seed)
    for step in range(3):  # the unseeded rows' shared generator advances alike
        rows, logits = _rows(19, seed * 10 + step), _logits(19, seed * 10 + step)
        a, b = new(logits, rows), old(logits, rows)
        want = Sampler._logprobs(torch.log_softmax(logits.float(), dim=-1), b.token_ids,
                                 [r.params for r in rows])
        assert a.token_ids == b.token_ids and a.logprobs == want


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    rows = [r for r in _rows(24, 5) if r.params.seed is not None and not r.params.greedy]
    logits = _logits(len(rows), 5)
    batch = Sampler(V, torch.device("cpu"), seed=1)(logits, rows).token_ids
    for i, row in enumerate(rows):
        alone = Sampler(V, torch.device("cpu"), seed=99)(logits[i:i + 1], [row]).token_ids
        assert alone == [batch[i]]


def test_host_staging_on_cpu_hands_back_the_array_itself() -> None:
    staging = device_sampling.HostStaging(torch.device("cpu"))
    arr = np.arange(6, dtype=np.int64).reshape(2, 3)
    out = staging.to_device("x", arr)
    assert out.tolist() == arr.tolist() and not staging._buffers
