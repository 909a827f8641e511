"""Per-request block tables on top of the block pool, with prefix-cache lookups.

The manager knows requests only by id and token ids. A request's block table is
append-only while it holds blocks; it is dropped whole when the request finishes
or is preempted.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from conveyor.core.block_pool import BlockPool, KVBlock
from conveyor.request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class ComputedBlocks:
    """Result of a prefix-cache lookup: blocks to share and the tokens they cover."""

    blocks: list[KVBlock]
    num_tokens: int


_NO_HIT = ComputedBlocks([], 0)


def chain_hash(parent: bytes, token_ids: list[int], extra_key: bytes) -> bytes:
    """Collision-safe (SHA-256) hash of a full block, chained over its parent's hash."""
    h = hashlib.sha256(parent)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    h.update(extra_key)
    return h.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 extra_hash_key: bytes = b"") -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        # Anything besides token ids that changes the KV (model id, LoRA, dtype) goes here.
        self._root = hashlib.sha256(b"conveyor-kv" + extra_hash_key).digest()
        self._extra = extra_hash_key
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._req_hashes: dict[str, list[bytes]] = {}
        self.stats = PrefixCacheStats()
        self.peak_used_blocks = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    # ---- prefix cache --------------------------------------------------------------------
    def _block_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the request's full blocks, extended incrementally as it grows."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            parent = hashes[-1] if hashes else self._root
            hashes.append(chain_hash(parent, tokens[i * bs:(i + 1) * bs], self._extra))
        return hashes

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix of full blocks; always leaves one token to compute."""
        if not self.enable_prefix_caching or request.num_computed_tokens > 0:
            return _NO_HIT
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in self._block_hashes(request)[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return ComputedBlocks(hits, len(hits) * self.block_size) if hits else _NO_HIT

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        self.stats.queries += num_queried
        self.stats.hits += num_hit

    def cache_computed_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        """Register the request's full blocks among its first ``num_tokens`` tokens.

        ``num_tokens`` defaults to what is computed. The scheduler may pass tokens that
        the current step is about to compute: within a step every layer writes all new
        K/V before any attention reads, so a request admitted later in the same step
        may already share those blocks.
        """
        if not self.enable_prefix_caching:
            return
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        if num_tokens is None:
            num_tokens = request.num_computed_tokens
        hashes = self._block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(hashes), len(blocks))
        for i in range(num_full):
            self.pool.cache(blocks[i], hashes[i])

    # ---- allocation ----------------------------------------------------------------------
    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed: ComputedBlocks = _NO_HIT) -> bool:
        return self._num_new_blocks(request, num_new_tokens, computed) is not None

    def _num_new_blocks(self, request: Request, num_new_tokens: int,
                        computed: ComputedBlocks) -> int | None:
        held = self.req_blocks.get(request.request_id, ())
        total_tokens = request.num_computed_tokens + computed.num_tokens + num_new_tokens
        n_new = max(0, self.blocks_needed(total_tokens) - len(held) - len(computed.blocks))
        # Hits with no other holder sit in the free queue: taking them shrinks what is free.
        n_hits_free = sum(1 for b in computed.blocks if b.ref_cnt == 0)
        if n_new > self.pool.num_free_blocks - n_hits_free:
            return None
        return n_new

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks = _NO_HIT) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens; returns the new block ids or None.

        ``computed`` (a prefix-cache hit, only for a request holding no blocks yet) is
        shared by reference and its block ids are included in the result.
        """
        n_new = self._num_new_blocks(request, num_new_tokens, computed)
        if n_new is None:
            return None
        table = self.req_blocks.setdefault(request.request_id, [])
        if computed.blocks:
            assert not table, "prefix hits are only taken by a request holding no blocks"
            self.pool.touch(computed.blocks)
            table.extend(computed.blocks)
        new_blocks = self.pool.allocate(n_new) if n_new else []
        assert new_blocks is not None
        table.extend(new_blocks)
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used_blocks)
        return [b.block_id for b in computed.blocks] + [b.block_id for b in new_blocks]

    def free(self, request_id: str) -> None:
        """Release every block the request holds (finish or preemption)."""
        blocks = self.req_blocks.pop(request_id, None)
        self._req_hashes.pop(request_id, None)
        if blocks:
            self.pool.release(list(reversed(blocks)))

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_cache()

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            ids = [b.block_id for b in blocks]
            assert len(ids) == len(set(ids)), "a block appears twice in one block table"
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but held by "
                f"{refs.get(block.block_id, 0)} block tables")
