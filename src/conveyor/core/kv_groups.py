"""A block table per layer group for hybrid models (Gemma 2's and 3's global and windowed
layers): the full-attention layers' KV keeps whole contexts, the windowed layers' is freed
behind the window, so their memory is bounded by it.

Each group is a ``KVCacheManager`` over its own pool (``config/kv_window.py: KVGroups``):
group 0 with no window, group 1 with the layers' window (which releases a request's
leading blocks as the all-windowed manager does: ``_num_dropped``). Both tables cover the
same tokens, so they have the same length and index i is token block i in either. The
scheduler sees one manager: a request gets room only where both groups give it (checked
before either allocates), frees and trims in both, and preemption counts each group's
blocks (``free_counts``, ``blocks_to_take``, ``exclusive_counts``: a tuple per group).

Prefix caching: each pool caches its own blocks under the same chained hashes. A hit is
the shorter of the two groups' longest cached prefixes, so every group holds every block
of it that its layers read (the windowed group's blocks in ``[h - window, h)`` among
them); the windowed group does not take the hit's blocks behind the window. The rule is
conservative: a windowed block evicted behind the window still cuts the hit there.
"""

from __future__ import annotations

from conveyor.core.block_pool import BlockPool
from conveyor.core.kv_cache_manager import ComputedBlocks, KVCacheManager, PrefixCacheStats
from conveyor.request import Request

_NO_HIT = ComputedBlocks([], 0)


class HybridKVCacheManager:
    """Group 0 (full attention) and group 1 (windowed by ``window``) tables per request."""

    def __init__(self, num_full_blocks: int, num_window_blocks: int, block_size: int,
                 window: int, enable_prefix_caching: bool = False,
                 extra_hash_key: bytes = b"") -> None:
        self.full = KVCacheManager(num_full_blocks, block_size, enable_prefix_caching,
                                   extra_hash_key)
        self.windowed = KVCacheManager(num_window_blocks, block_size, enable_prefix_caching,
                                       extra_hash_key, sliding_window=window)
        self.groups = (self.full, self.windowed)
        self.block_size = block_size
        self.window = window
        self.enable_prefix_caching = enable_prefix_caching

    # The all-windowed path's knob: a hybrid model has no single window.
    sliding_window = None

    # ---- what the scheduler and the engine read (group 0's, or both) ---------------------
    @property
    def pool(self) -> BlockPool:
        return self.full.pool

    @property
    def req_blocks(self) -> dict[str, list[int]]:
        return self.full.req_blocks

    @property
    def detached(self) -> dict[str, list[int]]:
        return self.full.detached

    @property
    def stats(self) -> PrefixCacheStats:
        return self.full.stats

    @property
    def hash_key(self) -> bytes:
        return self.full.hash_key

    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.full.num_free_blocks

    @property
    def usage(self) -> float:
        return max(g.usage for g in self.groups)

    @property
    def peak_used_blocks(self) -> int:
        return self.full.peak_used_blocks

    @property
    def num_window_freed(self) -> int:
        return self.windowed.num_window_freed

    def blocks_needed(self, num_tokens: int) -> int:
        return self.full.blocks_needed(num_tokens)

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        return self.full.block_ids(request_id, start)

    def window_block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The windowed group's table from index ``start`` on (its released entries too:
        an index is a position's block, and no layer reads those)."""
        return self.windowed.block_ids(request_id, start)

    def held_blocks(self, request_id: str) -> list[int]:
        return self.full.held_blocks(request_id)

    # ---- prefix cache --------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The full group's hit, cut to the windowed group's (the scheduler carries the
        full group's blocks; ``_window_hit`` finds the windowed group's again)."""
        full = self.full.get_computed_blocks(request)
        if not full.blocks:
            return _NO_HIT
        n = min(len(full.blocks), len(self.windowed.get_computed_blocks(request).blocks))
        return ComputedBlocks(full.blocks[:n], n * self.block_size) if n else _NO_HIT

    def _window_hit(self, request: Request, computed: ComputedBlocks) -> ComputedBlocks:
        """The windowed group's blocks of the hit ``computed`` (looked up again: both
        groups' blocks stay cached between a lookup and the allocation that takes it)."""
        if not computed.blocks:
            return _NO_HIT
        n = len(computed.blocks)
        blocks = self.windowed.get_computed_blocks(request).blocks
        assert len(blocks) >= n, "a hit the windowed group no longer holds"
        return ComputedBlocks(blocks[:n], computed.num_tokens)

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        self.full.record_lookup(num_queried, num_hit)

    def cache_computed_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        for g in self.groups:
            g.cache_computed_blocks(request, num_tokens)

    def forget_hashes_from(self, request_id: str, num_tokens: int) -> None:
        for g in self.groups:
            g.forget_hashes_from(request_id, num_tokens)

    # ---- allocation ----------------------------------------------------------------------
    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed: ComputedBlocks = _NO_HIT) -> bool:
        window_hit = self._window_hit(request, computed)
        return (self.full.can_allocate(request, num_new_tokens, computed)
                and self.windowed.can_allocate(request, num_new_tokens, window_hit))

    def free_counts(self) -> tuple[int, int]:
        """Blocks each group's pool can hand out now."""
        return self.full.num_free_blocks, self.windowed.num_free_blocks

    def blocks_to_take(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks = _NO_HIT) -> tuple[int, int]:
        """Free-queue blocks ``allocate_slots`` would take from each group's pool (the
        windowed group's as if its blocks behind the window were released first)."""
        window_hit = self._window_hit(request, computed)
        return (self.full.num_blocks_to_take(request, num_new_tokens, computed),
                max(0, self.windowed.num_blocks_to_take(request, num_new_tokens, window_hit)
                    - self.windowed.num_releasable_behind_window(request)))

    def exclusive_counts(self, request_id: str) -> tuple[int, int]:
        """Blocks only this request holds, per group: what freeing it gives back."""
        return (self.full.num_exclusive_blocks(request_id),
                self.windowed.num_exclusive_blocks(request_id))

    def num_blocks_to_take(self, request: Request, num_new_tokens: int,
                           computed: ComputedBlocks = _NO_HIT) -> int:
        return self.full.num_blocks_to_take(request, num_new_tokens, computed)

    def num_exclusive_blocks(self, request_id: str) -> int:
        return self.full.num_exclusive_blocks(request_id)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks = _NO_HIT) -> list[int] | None:
        """Room for ``num_new_tokens`` more tokens in both groups, or None (neither
        allocated). Returns the full group's new block ids (the windowed group's are
        ``window_block_ids``)."""
        # What the windowed group's window has passed goes back first (it is never read
        # again, whatever this call decides).
        self.windowed.release_behind_window(request)
        window_hit = self._window_hit(request, computed)
        if not (self.full.can_allocate(request, num_new_tokens, computed)
                and self.windowed.can_allocate(request, num_new_tokens, window_hit)):
            return None
        new = self.full.allocate_slots(request, num_new_tokens, computed)
        new_window = self.windowed.allocate_slots(request, num_new_tokens, window_hit)
        assert new is not None and new_window is not None
        assert len(self.full.req_blocks[request.request_id]) == \
            len(self.windowed.req_blocks[request.request_id]), "the groups' tables diverged"
        return new

    def trim(self, request: Request, num_tokens: int) -> int:
        n = self.full.trim(request, num_tokens)
        self.windowed.trim(request, num_tokens)
        return n

    def free(self, request_id: str) -> None:
        for g in self.groups:
            g.free(request_id)

    def detach(self, request_id: str, key: str) -> list[int]:
        raise ValueError("a hybrid model's block tables per layer group cannot be handed to "
                         "a KV transfer (kv_groups is off with one)")

    def release_detached(self, key: str) -> int:
        return 0

    def reset_prefix_cache(self) -> int:
        return sum(g.reset_prefix_cache() for g in self.groups)

    def check_invariants(self) -> None:
        for g in self.groups:
            g.check_invariants()
        assert self.full.req_blocks.keys() == self.windowed.req_blocks.keys()
        for rid, blocks in self.full.req_blocks.items():
            assert len(blocks) == len(self.windowed.req_blocks[rid]), rid
