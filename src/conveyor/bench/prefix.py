"""What a prefix cache could achieve on a workload, on paper: the infinite-cache ideal.

Two views, both replaying requests in arrival order into a cache that never evicts
and is never late (a request finds everything any earlier request computed):

- ``token_ideal``: from the token ids themselves, at the engine's granularity. A
  request hits its longest prefix of full ``block_size`` blocks that an earlier
  request computed (its prompt and every generated token but the last, whose KV is
  never computed), always leaving one prompt token to compute, as the engine does.
  It also counts the working set: the distinct full blocks the whole run computes,
  which is what a pool needs to hold so that no cached block is ever evicted.
- ``hash_id_ideal``: from a Mooncake trace's ``hash_ids`` alone, as the trace
  defines them: a request hits its leading hash ids that an earlier request had,
  ``block_tokens`` tokens each, capped at its prompt length.

Keys here are BLAKE2b digests over the raw token ids, independent of the engine's
own SHA-256 chain, so the ideal checks the engine instead of repeating it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from conveyor.bench.traces import TraceRow


@dataclass
class CacheIdeal:
    """Per-request hit tokens of an infinite cache, and what it takes to hold."""

    hit_tokens: list[int]
    prompt_tokens: list[int]
    working_set_blocks: int | None = None  # distinct full blocks computed (token view)

    @property
    def hits(self) -> int:
        return sum(self.hit_tokens)

    @property
    def queries(self) -> int:
        return sum(self.prompt_tokens)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def block_keys(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained keys of the full blocks of ``token_ids`` (a key names the whole prefix)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    keys: list[bytes] = []
    parent = b""
    for i in range(len(tokens) // block_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(tokens[i * block_size:(i + 1) * block_size].tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


def token_ideal(sequences: Iterable[tuple[Sequence[int], Sequence[int]]],
                block_size: int) -> CacheIdeal:
    """``sequences``: (prompt ids, generated ids) per request, in arrival order."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    seen: set[bytes] = set()
    hits: list[int] = []
    prompts: list[int] = []
    for prompt, output in sequences:
        if not prompt:
            raise ValueError("a request has an empty prompt")
        prompt = list(prompt)
        keys = block_keys(prompt, block_size)[:(len(prompt) - 1) // block_size]
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        hits.append(n * block_size)
        prompts.append(len(prompt))
        computed = prompt + list(output)[:-1]  # the last token is sampled, never fed back
        seen.update(block_keys(computed, block_size))
    return CacheIdeal(hits, prompts, working_set_blocks=len(seen))


def hash_id_ideal(rows: Iterable[TraceRow]) -> CacheIdeal:
    """The trace's own reuse: leading hash ids seen before, in arrival order.

    Hash ids name whole prefixes (the id at position k implies the k ids before it),
    so a trie over the id sequences finds the longest seen prefix.
    """
    root: dict[int, dict] = {}
    hits: list[int] = []
    prompts: list[int] = []
    for row in rows:
        node, n = root, 0
        for hid in row.hash_ids:
            if hid not in node:
                break
            node = node[hid]
            n += 1
        hits.append(min(n * row.block_tokens, row.input_len))
        prompts.append(row.input_len)
        node = root
        for hid in row.hash_ids:
            node = node.setdefault(hid, {})
    return CacheIdeal(hits, prompts)
