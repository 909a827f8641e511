"""A pool of fixed-size KV blocks with reference counts and a content-addressed cache.

Every block is in exactly one of three states:

    in use      ref_cnt > 0                     (held by one or more requests)
    evictable   ref_cnt == 0, block hash set    (its KV is still valid and findable)
    free        ref_cnt == 0, no hash           (holds nothing worth keeping)

Evictable and free blocks both sit in the free queue, ordered by eviction priority:
free blocks at the front, then evictable blocks least recently used first. Taking a
block for new data pops the front and evicts its hash if any.

Blocks are ids, and the pool's state is arrays, not an object per block: the reference
counts and the free queue (a doubly linked list threaded through two int arrays, with
one sentinel) take 12 bytes a block, hashes live in dicts of the cached blocks only. A
GPU with a small model holds millions of blocks: a million cost 12 MB and are built in
milliseconds (``benchmarks/experiments/block_pool_build.py``).
"""

from __future__ import annotations

from array import array


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        n = num_blocks
        self.num_blocks = n
        self.enable_caching = enable_caching
        self.ref_cnt = array("i", bytes(4 * n))  # zeros
        # The free queue: ids 0..n-1 in order, the sentinel n closing the ring.
        # Invariant: a block is in the queue iff its ref_cnt is 0.
        self._next = array("i", range(1, n + 2))
        self._next[n] = 0
        self._prev = array("i", range(-1, n))
        self._prev[0] = n
        self._num_free = n
        self._hash_of: dict[int, bytes] = {}  # block id -> hash (cached blocks only)
        self._cached: dict[bytes, int] = {}  # hash -> block id
        self.num_evictions = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free plus evictable)."""
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def num_evictable_blocks(self) -> int:
        ref = self.ref_cnt
        return sum(1 for b in self._cached.values() if ref[b] == 0)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def lookup(self, block_hash: bytes) -> int | None:
        """The block caching this content, or None."""
        return self._cached.get(block_hash)

    def block_hash(self, block_id: int) -> bytes | None:
        return self._hash_of.get(block_id)

    def free_queue(self) -> list[int]:
        """The free queue front to back (what ``allocate`` takes first comes first)."""
        out, nxt, end = [], self._next, self.num_blocks
        b = nxt[end]
        while b != end:
            out.append(b)
            b = nxt[b]
        return out

    def cached_hashes(self, limit: int) -> list[bytes]:
        """Up to ``limit`` hashes of cached blocks, those least likely to be evicted first:
        blocks in use, then evictable ones most recently used first (a router's view)."""
        if limit <= 0:
            return []
        ref = self.ref_cnt
        out = [h for h, b in self._cached.items() if ref[b] > 0][:limit]
        prev, end, hash_of = self._prev, self.num_blocks, self._hash_of
        b = prev[end]
        while b != end and len(out) < limit:
            h = hash_of.get(b)
            if h is None:
                break  # uncached free blocks sit at the front: none cached beyond
            out.append(h)
            b = prev[b]
        return out

    # ---- the free queue ------------------------------------------------------------------
    def _unlink(self, b: int) -> None:
        nxt, prev = self._next, self._prev
        p, q = prev[b], nxt[b]
        nxt[p] = q
        prev[q] = p

    def _push_back(self, b: int) -> None:
        nxt, prev, end = self._next, self._prev, self.num_blocks
        tail = prev[end]
        nxt[tail] = b
        prev[b] = tail
        nxt[b] = end
        prev[end] = b

    def _push_front(self, b: int) -> None:
        nxt, prev, end = self._next, self._prev, self.num_blocks
        head = nxt[end]
        nxt[end] = b
        prev[b] = end
        nxt[b] = head
        prev[head] = b

    # ---- mutations -----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` blocks for new data (evicting cached ones if needed), ref_cnt = 1 each."""
        if n > self._num_free:
            return None
        out = []
        nxt, prev, ref, end = self._next, self._prev, self.ref_cnt, self.num_blocks
        hash_of, cached = self._hash_of, self._cached
        b = nxt[end]
        for _ in range(n):  # pop the front n times (inlined: the hot path)
            out.append(b)
            ref[b] = 1
            if hash_of:
                h = hash_of.pop(b, None)
                if h is not None:
                    del cached[h]
                    self.num_evictions += 1
            b = nxt[b]
        nxt[end] = b
        prev[b] = end
        self._num_free -= n
        return out

    def touch(self, block_ids: list[int]) -> None:
        """Take one more reference on each block (a prefix-cache hit)."""
        ref = self.ref_cnt
        for b in block_ids:
            if ref[b] == 0:
                self._unlink(b)
                self._num_free -= 1
            ref[b] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference on each block, in the given order.

        Callers pass a request's blocks tail first, so that among blocks released
        together the deeper ones in a hash chain are evicted first.
        """
        ref, hash_of = self.ref_cnt, self._hash_of
        for b in block_ids:
            c = ref[b]
            if c <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            ref[b] = c - 1
            if c == 1:
                self._num_free += 1
                if b in hash_of:
                    self._push_back(b)  # most recently used of the evictable ones
                else:
                    self._push_front(b)  # nothing to keep: handed out before any cached one

    def cache(self, block_id: int, block_hash: bytes) -> None:
        """Make a computed, full block findable by its chained hash."""
        if not self.enable_caching or block_id in self._hash_of:
            return
        if block_hash in self._cached:
            return  # another block already holds the same content; keep that one
        self._hash_of[block_id] = block_hash
        self._cached[block_hash] = block_id

    def reset_cache(self) -> int:
        """Forget every evictable cached block; returns how many were dropped."""
        dropped = 0
        ref = self.ref_cnt
        for block_hash, b in list(self._cached.items()):
            if ref[b] == 0:
                del self._cached[block_hash]
                del self._hash_of[b]
                self._unlink(b)
                self._push_front(b)
                dropped += 1
        return dropped

    # ---- checking ------------------------------------------------------------------------
    def check_invariants(self) -> None:
        ref, n = self.ref_cnt, self.num_blocks
        queue = self.free_queue()
        assert len(queue) == self._num_free, (len(queue), self._num_free)
        assert len(set(queue)) == len(queue), "a block sits twice in the free queue"
        prev, b = self._prev, n
        for q in queue:  # the back links agree with the forward ones
            assert prev[q] == b, f"block {q}: broken back link"
            b = q
        assert prev[n] == b
        assert min(ref, default=0) >= 0, "a negative reference count"
        assert all(ref[q] == 0 for q in queue), "a block in use sits in the free queue"
        assert ref.count(0) == len(queue), "a block with no holder is missing from the queue"
        assert len(self._hash_of) == len(self._cached)
        assert all(self._cached.get(h) == b for b, h in self._hash_of.items())
        # Free blocks (no hash) always precede evictable ones in the queue.
        seen_cached = False
        for q in queue:
            if q in self._hash_of:
                seen_cached = True
            else:
                assert not seen_cached, "an uncached free block sits behind a cached one"
        in_use = n - ref.count(0)
        evictable = self.num_evictable_blocks
        free = len(queue) - evictable
        assert free + evictable + in_use == n
