"""Draft proposers behind one interface, and the factory that picks one by method.

A proposer guesses the next tokens of a request from what it has seen. It is asked
once per step for each request that sampled, with the request's whole token list
(prompt + output), and returns up to ``k`` tokens; they are verified at the request's
next step. Proposers here need no tensors: ``ngram`` (prompt lookup in the request's
own context), ``suffix`` (spec/suffix.py) and ``synthetic``; ``draft_model``
(runner/draft_model.py) runs a small model on the runner's device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.config import SpeculativeConfig
from conveyor.sampling_params import SamplingParams


@dataclass
class ProposeItem:
    req_id: str
    token_ids: Sequence[int]  # prompt + output so far
    k: int  # drafts wanted (>= 1)
    block_ids: list[int]  # its KV block table (a draft model writes its own K/V there)
    # The request's sampling (a proposer with a distribution draws from it under these).
    params: SamplingParams | None = None
    num_prompt_tokens: int = 0


class Proposer:
    name = "base"
    # Whether the last ``propose_batch`` did only a steady proposal's work (see
    # ``ModelRunnerOutput.propose_steady``); a proposer with a catch-up says when not.
    last_steady = True

    def propose(self, req_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        raise NotImplementedError

    def propose_batch(self, items: list[ProposeItem]) -> dict[str, list[int]]:
        out = {}
        for it in items:
            drafts = self.propose(it.req_id, it.token_ids, it.k)
            if drafts:
                out[it.req_id] = drafts
        return out

    def finish(self, req_id: str) -> None:
        """The request ended (finished or aborted): forget it."""


class _NgramIndex:
    """Where each n-gram of one request's context last ended, kept up to date as tokens
    are appended. Invariant: n-grams ending before ``seen - 1`` are indexed; the one
    ending at the last token is not (it is the suffix being looked up)."""

    __slots__ = ("last", "seen", "table")

    def __init__(self) -> None:
        self.seen = 0
        self.last = -1
        self.table: dict[tuple[int, ...], int] = {}


class NgramProposer(Proposer):
    """Prompt lookup (as vLLM's ``ngram``): the longest suffix of ``n`` tokens
    (``prompt_lookup_max`` down to ``min``) that occurred before in the request's context
    proposes the tokens that followed its latest earlier occurrence."""

    name = "ngram"

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._index: dict[str, _NgramIndex] = {}

    def _update(self, req_id: str, tokens: Sequence[int]) -> _NgramIndex:
        idx = self._index.get(req_id)
        n_tok = len(tokens)
        if idx is None or n_tok < idx.seen or (idx.seen and tokens[idx.seen - 1] != idx.last):
            idx = self._index[req_id] = _NgramIndex()  # new, or rewritten (preempted)
        table, lo, hi = idx.table, self.n_min, self.n_max
        for end in range(max(idx.seen - 1, 0), n_tok - 1):
            for n in range(lo, min(hi, end + 1) + 1):
                table[tuple(tokens[end - n + 1:end + 1])] = end
        idx.seen, idx.last = n_tok, tokens[-1] if n_tok else -1
        return idx

    def propose(self, req_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        if k <= 0 or not token_ids:
            return []
        table = self._update(req_id, token_ids).table
        n_tok = len(token_ids)
        for n in range(min(self.n_max, n_tok), self.n_min - 1, -1):
            end = table.get(tuple(token_ids[n_tok - n:]))
            if end is not None:
                return list(token_ids[end + 1:end + 1 + k])
        return []

    def finish(self, req_id: str) -> None:
        self._index.pop(req_id, None)


class SyntheticProposer(Proposer):
    """Drafts whose content does not matter: the verifier accepts them at a fixed rate
    (``acceptance_rate``), to sweep acceptance in benchmarks without a trained drafter."""

    name = "synthetic"

    def propose(self, req_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        return [token_ids[-1]] * k if token_ids and k > 0 else []


class _Delegate(Proposer):
    """A proposer object with ``propose``/``finish`` of its own, behind this interface."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.name = inner.name

    def propose(self, req_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        return self.inner.propose(req_id, token_ids, k)

    def propose_batch(self, items: list[ProposeItem]) -> dict[str, list[int]]:
        batch = getattr(self.inner, "propose_batch", None)
        return batch(items) if batch is not None else super().propose_batch(items)

    def finish(self, req_id: str) -> None:
        self.inner.finish(req_id)


def _suffix_trees(config: SpeculativeConfig):
    """The suffix proposer of ``config.suffix_backend`` (spec/suffix_native.py)."""
    from conveyor.spec.suffix_native import NativeSuffixProposer, native_suffix_available

    backend = config.suffix_backend
    if backend == "native" and not native_suffix_available():
        raise ValueError("speculative_config.suffix_backend 'native' needs Arctic "
                         "Inference's suffix trees, and arctic_inference.suffix_decoding "
                         "does not import (see CONTRIBUTING.md: install arctic-inference), or use "
                         "'python'")
    kwargs = dict(max_depth=config.suffix_max_depth,
                  max_cached_requests=config.suffix_max_cached_requests,
                  min_token_prob=config.suffix_min_token_prob,
                  max_spec_factor=config.suffix_max_spec_factor)
    if backend == "native" or (backend == "auto" and native_suffix_available()):
        return NativeSuffixProposer(config.num_speculative_tokens, **kwargs)
    from conveyor.spec.suffix import SuffixProposer

    return SuffixProposer(config.num_speculative_tokens, **kwargs)


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """A torch-free proposer; ``draft_model`` is built by the runner (it needs a device)."""
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "synthetic":
        return SyntheticProposer()
    if config.method == "suffix":
        return _Delegate(_suffix_trees(config))
    raise ValueError(f"method {config.method!r} has no torch-free proposer")
