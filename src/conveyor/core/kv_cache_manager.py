"""Per-request block tables on top of the block pool, with prefix-cache lookups.

The manager knows requests only by id and token ids. A request's block table is
append-only while it holds blocks; it is dropped whole when the request finishes
or is preempted.

Sliding window (``sliding_window``: every layer of the model attends within it): a
query at position q reads keys from q - window + 1 on, and no position below the next
one to compute is ever queried again, so the leading blocks wholly before the window of
the request's first uncomputed position are released as it advances. The table keeps
their ids in place (a table index is a position's block) but holds no reference to
them: ``_num_dropped`` counts those leading entries, which may by then belong to others
and which no layer reads (their ids stay valid, so a masked read stays finite). A
released block that is cached stays findable until evicted, for other requests' hits.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from conveyor.config.lora import lora_hash_key
from conveyor.core.block_pool import BlockPool
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
    """Result of a prefix-cache lookup: blocks (ids) to share and the tokens they cover."""

    blocks: list[int]
    num_tokens: int


_NO_HIT = ComputedBlocks([], 0)
_INT64_BYTES = array("q").itemsize


def chain_hash(parent: bytes, token_ids: list[int], extra_key: bytes) -> bytes:
    """Collision-safe (SHA-256) hash of a full block, chained over its parent's hash."""
    return _hash_block(parent, array("q", token_ids).tobytes(), extra_key)


def root_hash(extra_key: bytes) -> bytes:
    """The parent of a prompt's first block: the chain starts from the salt."""
    return hashlib.sha256(b"conveyor-kv" + extra_key).digest()


def prompt_block_hashes(token_ids: list[int], block_size: int, extra_key: bytes,
                        lora_id: int = 0) -> list[bytes]:
    """The chained hashes of the full blocks of ``token_ids``, as the prefix cache keys them
    for the base model or adapter ``lora_id`` (a router asks replicas which they hold)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    data = array("q", token_ids).tobytes()
    width = block_size * _INT64_BYTES
    parent, out = root_hash(lora_hash_key(extra_key, lora_id)), []
    for k in range(len(token_ids) // block_size):
        parent = _hash_block(parent, data[k * width:(k + 1) * width], extra_key)
        out.append(parent)
    return out


def _hash_block(parent: bytes, token_bytes: bytes, extra_key: bytes) -> bytes:
    # token_bytes: the block's ids as native int64 (what numpy's int64 tobytes() gives).
    h = hashlib.sha256(parent)
    h.update(token_bytes)
    h.update(extra_key)
    return h.digest()



class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 extra_hash_key: bytes = b"", sliding_window: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        # Anything besides token ids that changes the KV (model id, LoRA, dtype) goes here.
        self._root = root_hash(extra_hash_key)
        self._extra = extra_hash_key
        self.req_blocks: dict[str, list[int]] = {}  # request -> its block table (ids)
        # Blocks held by an in-flight KV transfer (a prefill's lease to a decode engine),
        # by transfer id: no request holds them, the free list does not have them.
        self.detached: dict[str, list[int]] = {}
        self._req_hashes: dict[str, list[bytes]] = {}
        # Leading blocks of each request that hold their own hash: they stay cached while
        # held, so cache_computed_blocks need not look at them again.
        self._num_registered: dict[str, int] = {}
        # Leading entries of each table released behind the window (sliding_window only).
        self._num_dropped: dict[str, int] = {}
        self.num_window_freed = 0  # blocks released behind a window, over the run
        self.stats = PrefixCacheStats()
        self.peak_used_blocks = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def hash_key(self) -> bytes:
        """The salt of every block hash (``config.kv_hash_key``)."""
        return self._extra

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """Ids of the request's blocks from index ``start`` on."""
        blocks = self.req_blocks.get(request_id, ())
        if start >= len(blocks):
            return []  # nothing new (most steps)
        return blocks[start:]

    # ---- prefix cache --------------------------------------------------------------------
    def _block_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the request's full blocks, extended incrementally as it grows."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        done, full = len(hashes), len(request.all_token_ids) // bs
        if full > done:
            # One conversion for all the new blocks, sliced per block: same bytes as
            # chain_hash on each block, without a list slice and an array per block.
            data = array("q", request.all_token_ids[done * bs:full * bs]).tobytes()
            width = bs * _INT64_BYTES
            # An adapter's chain starts from its own root (config/lora.py: lora_hash_key).
            parent = hashes[-1] if hashes else (self._root if not request.lora_id else root_hash(
                lora_hash_key(self._extra, request.lora_id)))
            for k in range(full - done):
                parent = _hash_block(parent, data[k * width:(k + 1) * width], self._extra)
                hashes.append(parent)
        return hashes

    def forget_hashes_from(self, request_id: str, num_tokens: int) -> None:
        """Drop the memoized hashes of blocks past the first ``num_tokens`` tokens: a token
        there changed (async scheduling's placeholder replaced by the sampled token)."""
        keep = num_tokens // self.block_size
        hashes = self._req_hashes.get(request_id)
        if hashes is not None:
            del hashes[keep:]
        if self._num_registered.get(request_id, 0) > keep:
            self._num_registered[request_id] = keep

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix of full blocks; always leaves one token to compute. None
        for a request that still needs prompt logprobs: they come from the prompt's
        positions' logits, which a hit would skip (its blocks are cached for others)."""
        if (not self.enable_prefix_caching or request.num_computed_tokens > 0
                or request.wants_prompt_logprobs):
            return _NO_HIT
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
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
        # Entries released behind the window are no longer this request's to register.
        start = max(self._num_registered.get(request.request_id, 0),
                    self._num_dropped.get(request.request_id, 0))
        if num_tokens // self.block_size <= start:
            return  # no block filled up since the last call (most decode steps)
        hashes = self._block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(hashes), len(blocks))
        for i in range(start, num_full):
            self.pool.cache(blocks[i], hashes[i])
        # A block whose content another block already caches stays unregistered (and is
        # retried every step, as that other block may be evicted meanwhile).
        hash_of = self.pool.block_hash
        while start < num_full and hash_of(blocks[start]) is not None:
            start += 1
        self._num_registered[request.request_id] = start

    # ---- allocation ----------------------------------------------------------------------
    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed: ComputedBlocks = _NO_HIT) -> bool:
        return self._num_new_blocks(request, num_new_tokens, computed) is not None

    def _blocks_wanted(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks) -> tuple[int, int]:
        """(new blocks to allocate, prefix hits that sit in the free queue)."""
        held = self.req_blocks.get(request.request_id, ())
        total_tokens = request.num_computed_tokens + computed.num_tokens + num_new_tokens
        n_new = max(0, self.blocks_needed(total_tokens) - len(held) - len(computed.blocks))
        # Hits with no other holder sit in the free queue: taking them shrinks what is free
        # (those behind the window are not taken).
        ref = self.pool.ref_cnt
        skip = self._num_behind_window(request.num_computed_tokens + computed.num_tokens) \
            if computed.blocks else 0
        n_hits_free = sum(1 for b in computed.blocks[skip:] if ref[b] == 0)
        return n_new, n_hits_free

    def _num_new_blocks(self, request: Request, num_new_tokens: int,
                        computed: ComputedBlocks) -> int | None:
        n_new, n_hits_free = self._blocks_wanted(request, num_new_tokens, computed)
        if n_new > self.pool.num_free_blocks - n_hits_free:
            return None
        return n_new

    def num_blocks_to_take(self, request: Request, num_new_tokens: int,
                           computed: ComputedBlocks = _NO_HIT) -> int:
        """Free-queue blocks ``allocate_slots`` would consume (it fails if fewer are free)."""
        return sum(self._blocks_wanted(request, num_new_tokens, computed))

    # Per layer group (one here; core/kv_groups.py has two): what preemption counts.
    def free_counts(self) -> tuple[int, ...]:
        return (self.pool.num_free_blocks,)

    def blocks_to_take(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks = _NO_HIT) -> tuple[int, ...]:
        return (self.num_blocks_to_take(request, num_new_tokens, computed),)

    def exclusive_counts(self, request_id: str) -> tuple[int, ...]:
        return (self.num_exclusive_blocks(request_id),)

    def window_block_ids(self, request_id: str, start: int = 0) -> list[int] | None:
        """A second layer group's table (core/kv_groups.py); None: one table."""
        return None

    def num_exclusive_blocks(self, request_id: str) -> int:
        """Blocks only this request holds: what freeing it gives back to the free queue."""
        ref = self.pool.ref_cnt
        return sum(1 for b in self.held_blocks(request_id) if ref[b] == 1)

    def held_blocks(self, request_id: str) -> list[int]:
        """The blocks the request holds a reference on: its table less the entries
        released behind the window."""
        blocks = self.req_blocks.get(request_id, [])
        return blocks[self._num_dropped.get(request_id, 0):]

    # ---- sliding window ------------------------------------------------------------------
    def _num_behind_window(self, num_computed: int) -> int:
        """Leading blocks no query at position >= ``num_computed`` reads: those ending at or
        before its window's first key, ``num_computed - window + 1``."""
        if self.sliding_window is None:
            return 0
        return max(0, (num_computed - self.sliding_window + 1) // self.block_size)

    def _passed_by_window(self, request: Request) -> list[int]:
        """The request's held leading blocks its next queries' windows have passed."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid, [])
        upto = min(self._num_behind_window(request.num_computed_tokens), len(blocks))
        return blocks[self._num_dropped.get(rid, 0):upto]

    def num_releasable_behind_window(self, request: Request) -> int:
        """Blocks only this request holds that its window has passed: what
        ``allocate_slots`` gives back to the free queue before it takes any."""
        ref = self.pool.ref_cnt
        return sum(1 for b in self._passed_by_window(request) if ref[b] == 1)

    def release_behind_window(self, request: Request) -> None:
        """Release the request's leading blocks its next queries' windows have passed
        (``allocate_slots`` does it first; a caller that checks room before allocating,
        like the hybrid manager, does it before the check, so the room counts them)."""
        passed = self._passed_by_window(request)
        if not passed:
            return
        self.pool.release(passed[::-1])
        rid = request.request_id
        self._num_dropped[rid] = self._num_dropped.get(rid, 0) + len(passed)
        self.num_window_freed += len(passed)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks = _NO_HIT) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens; returns the new block ids or None.

        ``computed`` (a prefix-cache hit, only for a request holding no blocks yet) is
        shared by reference and its block ids are included in the result.
        """
        if self.sliding_window is not None:
            self.release_behind_window(request)
        if not computed.blocks:
            held = self.req_blocks.get(request.request_id)
            if held is not None and \
                    request.num_computed_tokens + num_new_tokens <= len(held) * self.block_size:
                return []  # the blocks held have room (most decode steps)
        n_new = self._num_new_blocks(request, num_new_tokens, computed)
        if n_new is None:
            return None
        table = self.req_blocks.setdefault(request.request_id, [])
        if computed.blocks:
            assert not table, "prefix hits are only taken by a request holding no blocks"
            # Hits behind the window of the first position to compute are not taken.
            skip = self._num_behind_window(request.num_computed_tokens + computed.num_tokens)
            self.pool.touch(computed.blocks[skip:])
            table.extend(computed.blocks)
            if skip:
                self._num_dropped[request.request_id] = skip
        new_blocks = self.pool.allocate(n_new) if n_new else []
        assert new_blocks is not None
        table.extend(new_blocks)
        self.peak_used_blocks = max(self.peak_used_blocks, self.pool.num_used_blocks)
        return computed.blocks + new_blocks

    def trim(self, request: Request, num_tokens: int) -> int:
        """Release the request's trailing blocks beyond the first ``num_tokens`` slots
        (lookahead reserved for draft tokens that were rejected); returns how many.

        Those blocks hold no computed token of the request, so none is cached or shared.
        """
        blocks = self.req_blocks.get(request.request_id)
        keep = self.blocks_needed(num_tokens)
        if not blocks or len(blocks) <= keep:
            return 0
        tail = blocks[keep:]
        del blocks[keep:]
        ref, hash_of = self.pool.ref_cnt, self.pool.block_hash
        assert all(ref[b] == 1 and hash_of(b) is None for b in tail), \
            "a lookahead block is shared or cached"
        self.pool.release(list(reversed(tail)))
        return len(tail)

    def free(self, request_id: str) -> None:
        """Release every block the request holds (finish or preemption)."""
        blocks = self.req_blocks.pop(request_id, None)
        self._req_hashes.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        dropped = self._num_dropped.pop(request_id, 0)
        if blocks:
            self.pool.release(blocks[dropped:][::-1])

    def detach(self, request_id: str, key: str) -> list[int]:
        """Move a finishing request's blocks, references and all, to a transfer under
        ``key``; returns their ids. ``free(request_id)`` then finds nothing."""
        if key in self.detached:
            raise ValueError(f"blocks already detached under {key!r}")
        if self._num_dropped.get(request_id):
            raise ValueError("a request whose blocks were released behind its window cannot "
                             "hand its K/V to a transfer")
        blocks = self.req_blocks.pop(request_id, [])
        self._req_hashes.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        self.detached[key] = blocks
        return list(blocks)

    def release_detached(self, key: str) -> int:
        """Give a transfer's blocks back (once: a second call finds none); returns how many."""
        blocks = self.detached.pop(key, None)
        if blocks:
            self.pool.release(list(reversed(blocks)))
        return len(blocks or ())

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_cache()

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        refs: dict[int, int] = {}
        tables = [self.held_blocks(rid) for rid in self.req_blocks]
        for blocks in [*tables, *self.detached.values()]:
            assert len(blocks) == len(set(blocks)), "a block appears twice in one block table"
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
        for b, count in enumerate(self.pool.ref_cnt):
            assert count == refs.get(b, 0), (
                f"block {b}: ref_cnt {count} but held by {refs.get(b, 0)} block tables")
