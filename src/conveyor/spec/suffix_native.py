"""The ``suffix`` proposer on Arctic Inference's suffix trees (C++), when installed.

Snowflake's ``arctic_inference.suffix_decoding`` is the SuffixDecoding authors' own
implementation, the one vLLM's ``suffix`` method calls. Its trees are ours in kind (a
per-request tree over the request's prompt and outputs; a global tree over the outputs
of recent requests, FIFO, ``max_cached_requests``) and differ in when the global tree
learns: a request's outputs go in as they are shown to it, not when the request ends.
What it buys is speed: its inserts run in C++ rather than Python (spec/suffix.py; figures
in docs/results/), and a request's first proposal builds its tree over the whole prompt.

``suffix_backend`` in ``speculative_config`` picks it: ``"auto"`` (the default) uses it
when ``arctic_inference`` imports, else the Python trees; ``"native"`` requires it;
``"python"`` never uses it. Drafts are verified as any proposer's, so greedy output is
the same whatever the backend; the drafts themselves may differ.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["NativeSuffixProposer", "native_suffix_available"]


def native_suffix_available() -> bool:
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
    except Exception:  # not installed, or built for another Python or torch
        return False
    return True


@dataclass
class _Seen:
    """What the trees hold of one running request: its first ``num_tokens`` tokens
    (the prompt's ``num_prompt_tokens`` of them in its own tree only)."""

    num_tokens: int
    last_token: int
    first_token: int


class NativeSuffixProposer:
    """``propose``/``propose_batch``/``finish`` as spec/suffix.py's ``SuffixProposer``,
    on ``arctic_inference.suffix_decoding.SuffixDecodingCache``."""

    name = "suffix"

    def __init__(self, num_speculative_tokens: int, *, max_depth: int = 32,
                 max_cached_requests: int = 1000, min_token_prob: float = 0.1,
                 max_spec_factor: float = 1.0) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.num_speculative_tokens = num_speculative_tokens
        self.max_depth = max_depth
        self.min_token_prob = min_token_prob
        self.max_spec_factor = max_spec_factor
        # Windows of max_depth + k tokens, as the Python trees keep: a full-length match
        # still has a full draft after it.
        self._cache = SuffixDecodingCache(
            max_tree_depth=max_depth + max(1, num_speculative_tokens),
            max_cached_requests=max_cached_requests)
        self._seen: dict[str, _Seen] = {}

    def propose_batch(self, items: Sequence) -> dict[str, list[int]]:
        out = {}
        for it in items:
            drafts = self.propose(it.req_id, it.token_ids, it.k,
                                  num_prompt_tokens=it.num_prompt_tokens)
            if drafts:
                out[it.req_id] = drafts
        return out

    def propose(self, req_id: str, token_ids: Sequence[int], k: int,
                num_prompt_tokens: int = 0) -> list[int]:
        """Up to min(k, num_speculative_tokens) draft tokens continuing ``token_ids``
        (prompt + outputs so far; the first ``num_prompt_tokens`` are the prompt)."""
        n = len(token_ids)
        if not n:
            return []
        self._take_in(req_id, token_ids, num_prompt_tokens)
        limit = min(k, self.num_speculative_tokens)
        if limit <= 0:
            return []
        context = list(token_ids[max(0, n - self.max_depth):])
        draft = self._cache.speculate(req_id, context, max_spec_tokens=limit,
                                      max_spec_factor=self.max_spec_factor,
                                      min_token_prob=self.min_token_prob)
        return list(draft.token_ids[:limit])

    def finish(self, req_id: str) -> None:
        """The request ended: its own tree goes; its outputs stay in the global tree
        until the FIFO of ``max_cached_requests`` evicts them."""
        if self._seen.pop(req_id, None) is not None:
            self._cache.stop_request(req_id)

    def _take_in(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Show the trees the tokens they have not seen. A list that does not extend what
        they saw (a preempted request recomputed otherwise) starts the request over."""
        n = len(token_ids)
        seen = self._seen.get(req_id)
        if seen is not None and (n < seen.num_tokens or token_ids[0] != seen.first_token
                                 or token_ids[seen.num_tokens - 1] != seen.last_token):
            self._cache.stop_request(req_id)  # (start_request drops its cached outputs)
            seen = None
        if seen is None:
            prompt = min(max(num_prompt_tokens, 1), n)  # (its tree needs a token)
            self._cache.start_request(req_id, list(token_ids[:prompt]))
            seen = self._seen[req_id] = _Seen(prompt, token_ids[prompt - 1], token_ids[0])
        if n > seen.num_tokens:
            self._cache.add_active_response(req_id, list(token_ids[seen.num_tokens:]))
            seen.num_tokens, seen.last_token = n, token_ids[n - 1]

    def stats(self) -> dict:
        return {"active_requests": len(self._cache.active_requests),
                "cached_requests": len(self._cache.cached_requests),
                "backend": "arctic_inference"}
