"""A pool of fixed-size KV blocks with reference counts and a content-addressed cache.

Every block is in exactly one of three states:

    in use      ref_cnt > 0                     (held by one or more requests)
    evictable   ref_cnt == 0, block_hash set    (its KV is still valid and findable)
    free        ref_cnt == 0, no hash           (holds nothing worth keeping)

Evictable and free blocks both sit in ``_free_queue``, ordered by eviction
priority: free blocks at the front, then evictable blocks least recently used
first. Taking a block for new data pops the front and evicts its hash if any.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Chained content hash of the tokens this block holds; set only once its KV is computed.
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free_queue: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVBlock] = {}
        self.num_evictions = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free plus evictable)."""
        return len(self._free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_evictable_blocks(self) -> int:
        return sum(1 for b in self._cached.values() if b.ref_cnt == 0)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def cached_hashes(self, limit: int) -> list[bytes]:
        """Up to ``limit`` hashes of cached blocks, those least likely to be evicted first:
        blocks in use, then evictable ones most recently used first (a router's view)."""
        if limit <= 0:
            return []
        out = [h for h, b in self._cached.items() if b.ref_cnt > 0][:limit]
        for block in reversed(self._free_queue.values()):
            if len(out) >= limit or block.block_hash is None:
                break  # uncached free blocks sit at the front: none cached beyond
            out.append(block.block_hash)
        return out

    # ---- mutations -----------------------------------------------------------------------
    def allocate(self, n: int) -> list[KVBlock] | None:
        """Take ``n`` blocks for new data (evicting cached ones if needed), ref_cnt = 1 each."""
        if n > len(self._free_queue):
            return None
        out = []
        for _ in range(n):
            _, block = self._free_queue.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop one reference on each block, in the given order.

        Callers pass a request's blocks tail first, so that among blocks released
        together the deeper ones in a hash chain are evicted first.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block
                if block.block_hash is None:
                    # Nothing to keep: hand this one out before any cached block.
                    self._free_queue.move_to_end(block.block_id, last=False)

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Make a computed, full block findable by its chained hash."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # another block already holds the same content; keep that one
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_cache(self) -> int:
        """Forget every evictable cached block; returns how many were dropped."""
        dropped = 0
        for block_hash, block in list(self._cached.items()):
            if block.ref_cnt == 0:
                del self._cached[block_hash]
                block.block_hash = None
                self._free_queue.move_to_end(block.block_id, last=False)
                dropped += 1
        return dropped

    # ---- checking ------------------------------------------------------------------------
    def check_invariants(self) -> None:
        free_ids = set(self._free_queue)
        assert len(free_ids) == len(self._free_queue)
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} ref_cnt {block.ref_cnt}"
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in free queue "
                f"{block.block_id in free_ids}")
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block
        assert all(b.block_hash == h for h, b in self._cached.items())
        # Free blocks (no hash) always precede evictable ones in the queue.
        seen_cached = False
        for block in self._free_queue.values():
            if block.block_hash is not None:
                seen_cached = True
            else:
                assert not seen_cached, "an uncached free block sits behind a cached one"
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        evictable = self.num_evictable_blocks
        free = len(self._free_queue) - evictable
        assert free + evictable + in_use == self.num_blocks
