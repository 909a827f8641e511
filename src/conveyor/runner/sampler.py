"""Batched sampling: logit_bias, penalties, min_tokens, temperature, top-k/top-p/min-p,
logprobs.

Greedy rows take an argmax. Random rows use the exponential race
``argmax(p / q)`` with ``q ~ Exp(1)``, which samples from ``p`` exactly. A row
with a ``seed`` draws its ``q`` from a generator seeded by (seed, output position)
alone, so its tokens do not depend on which other requests share the batch, nor
on preemption; rows without a seed share the engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from conveyor.runner import device_sampling
from conveyor.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs of one request (built by the runner)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: (top ids, top logprobs, rank of the sampled token, its logprob) or None.
    logprobs: list[tuple[list[int], list[float], int, float] | None]


# Salt of the acceptance draws' stream (apart from the race noise of the same position).
_UNIFORM_STREAM = 0x5EC0DE


def _seed_for(seed: int, position: int) -> int:
    # A splitmix-style mix so nearby (seed, position) pairs give unrelated streams.
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) & ((1 << 64) - 1)
    x ^= x >> 31
    return x & ((1 << 63) - 1)


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._row_generator = torch.Generator(device=device)
        self.staging = device_sampling.HostStaging(device)  # pinned inputs on CUDA

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """logits: [N, V] in the model's dtype, one row per request that samples."""
        logits, raw_logprobs = self.process(logits, rows)
        params = [r.params for r in rows]
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample_random(logits, rows, greedy)
        # Tokens and logprobs leave the device in one copy (runner/device_sampling.py).
        return SamplerOutput(*device_sampling.results(tokens, raw_logprobs, params))

    # ---- the pieces (speculative verification composes the same ones) -------------------
    def process(self, logits: torch.Tensor, rows: list[SamplingRow]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float32 logits after logit_bias, penalties and min_tokens, and the raw
        log-probabilities (None unless a row asked for logprobs; logit_bias is not in
        them, as penalties are not: they are the model's)."""
        logits = logits.float()
        params = [r.params for r in rows]
        raw_logprobs = (torch.log_softmax(logits, dim=-1)
                        if any(p.logprobs is not None for p in params) else None)
        if any(p.logit_bias for p in params):
            logits = self._apply_logit_bias(logits, params)
        if any(p.needs_penalties for p in params):
            logits = self._apply_penalties(logits, rows)
        if any(len(r.output_token_ids) < r.params.min_tokens for r in rows):
            logits = self._block_stops(logits, rows)
        return logits, raw_logprobs

    def probs(self, logits: torch.Tensor, params: list[SamplingParams],
              greedy: list[bool]) -> torch.Tensor:
        """What a random row samples from: temperature, top-k, top-p, softmax, min-p
        (greedy rows at temperature 1). Rows are not renormalized after min-p."""
        temps = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)],
                             dtype=logits.dtype, device=self.device)
        logits = logits / temps.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            logits = self._top_k_top_p(logits, params)
        probs = torch.softmax(logits, dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype,
                                 device=self.device)
            threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
            probs = probs.masked_fill(probs < threshold, 0.0)
        return probs

    def noise(self, rows: list[SamplingRow], greedy: list[bool], like: torch.Tensor
              ) -> torch.Tensor:
        """Exp(1) noise for the race ``argmax(p / q)``: a seeded row's from (seed, its
        output position) alone, the others' from the engine's generator."""
        q = torch.empty_like(like)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            idx = torch.tensor(unseeded, device=self.device)
            q[idx] = torch.empty((len(unseeded), like.shape[1]), device=self.device,
                                 dtype=like.dtype).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.params.seed is not None and not greedy[i]:
                self.seeded_noise(row.params.seed, len(row.output_token_ids), q[i])
        return q

    def seeded_noise(self, seed: int, position: int, out: torch.Tensor) -> torch.Tensor:
        """Fill ``out`` with the Exp(1) race noise of (seed, output position): what a
        seeded row at that position draws, whoever asks (a draft model coupling its
        draft to the target's draw asks too)."""
        self._row_generator.manual_seed(_seed_for(seed, position))
        return out.exponential_(generator=self._row_generator)

    def uniform(self, rows: list[SamplingRow]) -> torch.Tensor:
        """One U(0, 1) per row (speculative acceptance), seeded rows from (seed, position)
        on a stream apart from their noise's."""
        u = torch.rand(len(rows), generator=self.generator, device=self.device)
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                self._row_generator.manual_seed(
                    _seed_for(row.params.seed ^ _UNIFORM_STREAM, len(row.output_token_ids)))
                u[i] = torch.rand(1, generator=self._row_generator, device=self.device)[0]
        return u

    # ---- logits processing ---------------------------------------------------------------
    def _apply_logit_bias(self, logits: torch.Tensor, params: list[SamplingParams]
                          ) -> torch.Tensor:
        """Every row's biases added in one scatter for the batch (a new tensor: the
        caller's logits stay the model's)."""
        rows, cols, vals = [], [], []
        for i, p in enumerate(params):
            for token, bias in (p.logit_bias or {}).items():
                rows.append(i)
                cols.append(token)
                vals.append(float(bias))
        index = (torch.tensor(rows, device=self.device), torch.tensor(cols, device=self.device))
        return logits.index_put(index, torch.tensor(vals, dtype=logits.dtype,
                                                    device=self.device), accumulate=True)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        return device_sampling.apply_penalties(logits, rows, self.vocab_size, self.staging)

    def _apply_penalties_per_row(self, logits: torch.Tensor, rows: list[SamplingRow]
                                 ) -> torch.Tensor:
        """The per-row loop ``_apply_penalties`` replaced (tests compare the two)."""
        logits = logits.clone()
        v = self.vocab_size
        for i, row in enumerate(rows):
            p = row.params
            if not p.needs_penalties:
                continue
            out = torch.tensor(row.output_token_ids, dtype=torch.long, device=self.device)
            counts = torch.zeros(v, dtype=logits.dtype, device=self.device)
            if out.numel():
                counts.scatter_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
            if p.repetition_penalty != 1.0:
                seen = counts > 0
                prompt = torch.tensor(row.prompt_token_ids, dtype=torch.long, device=self.device)
                seen[prompt] = True
                lg = logits[i]
                penalized = torch.where(lg > 0, lg / p.repetition_penalty,
                                        lg * p.repetition_penalty)
                logits[i] = torch.where(seen, penalized, lg)
            if p.frequency_penalty:
                logits[i] -= p.frequency_penalty * counts
            if p.presence_penalty:
                logits[i] -= p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    def _block_stops(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Below min_tokens, EOS and stop tokens cannot be sampled."""
        return device_sampling.block_stops(logits, rows, self.vocab_size, self.staging)

    def _block_stops_per_row(self, logits: torch.Tensor, rows: list[SamplingRow]
                             ) -> torch.Tensor:
        """The per-row loop ``_block_stops`` replaced (tests compare the two)."""
        logits = logits.clone()
        for i, row in enumerate(rows):
            p = row.params
            if len(row.output_token_ids) >= p.min_tokens:
                continue
            stops = set(p.stop_token_ids)
            if not p.ignore_eos:
                stops |= p.eos_token_ids
            ids = [t for t in stops if t < self.vocab_size]
            if ids:
                logits[i, ids] = float("-inf")
        return logits

    # ---- sampling ------------------------------------------------------------------------
    def _sample_random(self, logits: torch.Tensor, rows: list[SamplingRow],
                       greedy: list[bool]) -> torch.Tensor:
        params = [r.params for r in rows]
        n = logits.shape[0]
        greedy_tokens = logits.argmax(dim=-1)
        probs = self.probs(logits, params, greedy)
        sampled = (probs / self.noise(rows, greedy, probs)).argmax(dim=-1)
        is_greedy = self.staging.to_device("greedy", np.array(greedy, dtype=np.bool_)).view(n)
        return torch.where(is_greedy, greedy_tokens, sampled)

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        v = logits.shape[1]
        sorted_logits, order = logits.sort(dim=-1)  # ascending
        k = torch.tensor([p.top_k if 0 < p.top_k < v else v for p in params],
                         device=logits.device)
        kth = sorted_logits.gather(1, (v - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype,
                             device=logits.device)
        if any(p.top_p < 1.0 for p in params):  # (a host check: no device sync)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop = cum <= (1.0 - top_p).unsqueeze(1)
            drop[:, -1] = False  # always keep the most likely token
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)

    # ---- logprobs ------------------------------------------------------------------------
    @staticmethod
    def logprob_of(row: torch.Tensor, token: int, params: SamplingParams
                   ) -> tuple[list[int], list[float], int, float]:
        """(top ids, top logprobs, rank of ``token``, its logprob) from a raw logprob row."""
        lp = row[token]
        rank = int((row > lp).sum().item()) + 1
        if params.logprobs:
            top = torch.topk(row, params.logprobs)
            ids, vals = top.indices.tolist(), top.values.tolist()
        else:
            ids, vals = [], []
        return ids, vals, rank, float(lp.item())

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, tokens: list[int], params: list[SamplingParams]
                  ) -> list[tuple[list[int], list[float], int, float] | None]:
        if raw is None:
            return [None] * len(tokens)
        out: list[tuple[list[int], list[float], int, float] | None] = []
        for i, p in enumerate(params):
            out.append(None if p.logprobs is None
                       else Sampler.logprob_of(raw[i], tokens[i], p))
        return out
