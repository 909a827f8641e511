"""Property tests for the block pool and the KV cache manager."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.core.block_pool import BlockPool
from conveyor.core.kv_cache_manager import KVCacheManager

from helpers import make_request


def test_allocate_release_and_double_free() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert [pool.ref_cnt[b] for b in blocks] == [1, 1, 1] and pool.num_free_blocks == 1
    assert pool.allocate(2) is None, "cannot hand out more than is free"
    pool.release(blocks)
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="double free"):
        pool.release(blocks[:1])
    pool.check_invariants()


def test_cached_blocks_are_evicted_lru_and_free_ones_first() -> None:
    pool = BlockPool(4, enable_caching=True)
    a, b, c, d = pool.allocate(4)
    pool.cache(a, b"a")
    pool.cache(b, b"b")
    pool.release([a])
    pool.release([c])  # uncached: handed out before any cached block
    pool.release([b])
    pool.release([d])
    pool.check_invariants()
    assert pool.num_evictable_blocks == 2
    first, second = pool.allocate(2)
    assert {first, second} == {c, d}
    third = pool.allocate(1)[0]
    assert third == a and pool.lookup(b"a") is None, "least recently used cached block first"
    assert pool.lookup(b"b") == b


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grow", "free", "share"]), st.integers(0, 7),
                          st.integers(1, 40)), min_size=1, max_size=60),
       st.booleans())
def test_manager_never_leaks_or_double_frees(ops, caching) -> None:
    """Random grow/free/share sequences keep ref counts equal to block-table holders."""
    kv = KVCacheManager(num_blocks=24, block_size=4, enable_prefix_caching=caching)
    reqs = {}
    for op, slot, n in ops:
        rid = f"r{slot}"
        if op == "free":
            kv.free(rid)
            reqs.pop(rid, None)
        elif op == "share" and rid not in reqs:
            # a new request with a common prefix: may hit cached blocks
            req = make_request(rid if slot % 2 else "same", n, 4)
            req.request_id = rid
            hit = kv.get_computed_blocks(req)
            assert hit.num_tokens < req.num_tokens, "at least one token is always computed"
            if kv.allocate_slots(req, req.num_tokens - hit.num_tokens, hit) is not None:
                req.num_computed_tokens = req.num_tokens
                kv.cache_computed_blocks(req)
                reqs[rid] = req
        elif op == "grow":
            req = reqs.get(rid)
            if req is None:
                req = make_request(rid, 1, 4)
                req.num_computed_tokens = 0
            before = len(kv.block_ids(rid))
            new = kv.allocate_slots(req, n)
            if new is None:
                assert len(kv.block_ids(rid)) == before, "a failed allocation changes nothing"
            else:
                req.num_computed_tokens += n
                req.all_token_ids.extend([3] * n)
                reqs[rid] = req
                assert len(kv.block_ids(rid)) == -(-req.num_computed_tokens // 4)
        kv.check_invariants()
    for rid in list(reqs):
        kv.free(rid)
    kv.check_invariants()
    assert kv.num_free_blocks == 24


def test_prefix_hit_shares_blocks_and_leaves_one_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = make_request("a", 12, 4)
    kv.allocate_slots(first, 12)
    first.num_computed_tokens = 12
    kv.cache_computed_blocks(first)
    second = make_request("a", 12, 4)  # same prompt (prompts derive from the id length)
    second.request_id = "b"
    hit = kv.get_computed_blocks(second)
    assert hit.num_tokens == 8, "12 tokens: 2 full blocks reused, the last block recomputed"
    kv.allocate_slots(second, 4, hit)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert [kv.pool.ref_cnt[i] for i in kv.block_ids("b")[:2]] == [2, 2]
    kv.free("a")
    kv.free("b")
    kv.check_invariants()
    assert kv.pool.num_evictable_blocks == 3


def test_cached_hashes_for_a_router_held_first_then_most_recent_and_capped() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.cache(b, bytes([i]) * 32)
    pool.release([blocks[0]])  # evictable, released first (least recent)
    pool.release([blocks[1]])  # evictable, most recent
    held = {bytes([2]) * 32, bytes([3]) * 32}
    got = pool.cached_hashes(10)
    assert set(got[:2]) == held and got[2:] == [bytes([1]) * 32, bytes([0]) * 32]
    assert set(pool.cached_hashes(2)) == held
    assert pool.cached_hashes(3)[2] == bytes([1]) * 32
    assert pool.cached_hashes(0) == []
    pool.allocate(3)  # two free blocks, then the least recent cached one is evicted
    assert bytes([0]) * 32 not in pool.cached_hashes(10)


def test_a_million_blocks_are_arrays_not_objects() -> None:
    """A GPU with a small model holds millions of blocks: the pool's state is three int
    arrays (12 bytes a block) and dicts of the cached blocks only."""
    import tracemalloc

    tracemalloc.start()
    pool = BlockPool(1_000_000)
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert size < 16 * 2**20, size
    taken = pool.allocate(999_999)
    assert taken[:3] == [0, 1, 2] and taken[-1] == 999_998 and pool.num_free_blocks == 1
    pool.cache(taken[5], b"h")
    pool.release(taken[::-1])
    assert pool.num_free_blocks == 1_000_000 and pool.lookup(b"h") == 5
    assert pool.free_queue()[-1] == 5  # the cached block is evicted last
    assert pool.allocate(1_000_000)[-1] == 5 and pool.lookup(b"h") is None
