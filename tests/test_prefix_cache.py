"""Automatic prefix caching: exact outputs, eviction, preemption, invariants."""

from __future__ import annotations

import argparse
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import LLM, SamplingParams
from conveyor.config import EngineArgs
from conveyor.core.kv_cache_manager import KVCacheManager, chain_hash

from helpers import fake_execute, hf_greedy, make_checkpoint, make_request, make_scheduler


def shared_prefix_prompts(seed: int, n: int = 12) -> list[list[int]]:
    """Prompts drawn from three 'system prompts' with user suffixes of varied length."""
    rng = random.Random(seed)
    systems = [[rng.randrange(4, 384) for _ in range(k)] for k in (8, 21, 35)]
    return [rng.choice(systems)[:rng.randint(3, 35)] +
            [rng.randrange(4, 384) for _ in range(rng.randint(1, 12))] for _ in range(n)]


def test_cache_on_equals_cache_off_equals_transformers_under_pressure() -> None:
    path = make_checkpoint("llama")
    prompts = shared_prefix_prompts(1)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    # 14 blocks of 8 tokens for 12 requests of up to 57 tokens: eviction and preemption.
    on = LLM(path, dtype="float32", block_size=8, num_kv_blocks=14, max_num_seqs=6)
    off = LLM(path, dtype="float32", block_size=8, num_kv_blocks=14, max_num_seqs=6,
              enable_prefix_caching=False)
    sched = on.engine.scheduler
    schedule = sched.schedule
    rejoined: list[int] = []  # computed tokens of each readmission after a preemption

    def spy(now: float):
        out = schedule(now)
        rejoined.extend(new.num_computed_tokens for new in out.new_reqs
                        if sched.requests[new.req_id].num_preemptions > 0)
        return out

    sched.schedule = spy
    got_on = [o.outputs[0].token_ids for o in on.generate(inputs, params)]
    got_on2 = [o.outputs[0].token_ids for o in on.generate(inputs, params)]  # warm cache
    got_off = [o.outputs[0].token_ids for o in off.generate(inputs, params)]
    want = [hf_greedy(path, p, 10) for p in prompts]
    assert got_on == want and got_on2 == want and got_off == want
    stats = on.stats()
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_preemptions"] > 0 and on.engine.kv.pool.num_evictions > 0
    assert any(n > 0 for n in rejoined), "a preempted request should rejoin through the cache"
    assert off.stats()["prefix_cache_hits"] == 0


def test_hit_rate_counts_prompt_tokens() -> None:
    llm = LLM("tiny", block_size=4, num_kv_blocks=64)
    prompt = list(range(10, 30))  # 20 tokens: 4 full blocks reusable, the 5th recomputed
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params)
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    stats = llm.stats()
    assert stats["prefix_cache_queries"] == 40
    assert stats["prefix_cache_hits"] == 16 == out.num_cached_tokens
    assert out.metrics.num_cached_tokens == 16


def test_reset_prefix_cache_forgets_what_no_request_holds() -> None:
    llm = LLM("tiny", block_size=4, num_kv_blocks=64)
    prompt = {"prompt_token_ids": list(range(10, 30))}
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    llm.generate([prompt], params)
    assert llm.generate([prompt], params)[0].num_cached_tokens == 16
    assert llm.reset_prefix_cache() >= 4  # the prompt's 4 full blocks, at least
    assert llm.generate([prompt], params)[0].num_cached_tokens == 0
    assert llm.reset_prefix_cache() >= 4 and llm.reset_prefix_cache() == 0
    llm.engine.kv.check_invariants()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30), st.integers(1, 8)),
                min_size=2, max_size=20), st.integers(6, 30))
def test_running_blocks_are_never_evicted(reqs, num_blocks) -> None:
    """Blocks held by running requests keep their ref counts and their hash entries."""
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_seqs=4,
                           max_num_batched_tokens=16, enable_prefix_caching=True)
    pending = []
    for i, (family, prompt_len, out_len) in enumerate(reqs):
        prompt_len = min(prompt_len, num_blocks * 4 - out_len - 1)
        if prompt_len < 1:
            continue
        req = make_request(f"f{family}", prompt_len, out_len)  # same family: same prefix
        req.request_id = f"r{i}"
        pending.append(req)
    for req in pending:
        sched.add_request(req, 0.0)
    for step in range(2000):
        if not sched.has_unfinished():
            break
        out = sched.schedule(float(step))
        sched.update(out, fake_execute(out), float(step))
        sched.check_invariants()
        pool = sched.kv.pool
        for req in sched.running:
            for block in sched.kv.req_blocks.get(req.request_id, []):
                assert pool.ref_cnt[block] > 0
                if pool.block_hash(block) is not None:
                    assert pool.lookup(pool.block_hash(block)) == block
        assert pool.num_free_blocks + pool.num_used_blocks == num_blocks
    assert not sched.has_unfinished()


def test_prefix_caching_is_on_by_default_and_can_be_turned_off() -> None:
    """The documented default (docs/prefix_caching.md): on, as in vLLM V1."""
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs().enable_prefix_caching
    assert EngineArgs.from_cli_args(parser.parse_args([])).enable_prefix_caching
    off = parser.parse_args(["--no-enable-prefix-caching"])
    assert not EngineArgs.from_cli_args(off).enable_prefix_caching
    llm = LLM("tiny", num_kv_blocks=32)
    assert llm.engine.config.cache.enable_prefix_caching and llm.engine.kv.enable_prefix_caching


def test_blocks_released_together_evict_the_deepest_first() -> None:
    """A finished request's chain loses its tail first, so its prefix stays findable."""
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    first = make_request("a", 12, 4)  # 3 full blocks, the 4th block stays free
    kv.allocate_slots(first, 12)
    first.num_computed_tokens = 12
    kv.cache_computed_blocks(first)
    chain = kv.block_ids("a")
    kv.free("a")
    kv.check_invariants()
    taken = kv.pool.allocate(2)  # the uncached free block, then the deepest cached one
    assert chain[2] in taken and chain[0] not in taken and chain[1] not in taken
    again = make_request("a", 12, 4)
    again.request_id = "again"
    assert kv.get_computed_blocks(again).blocks == chain[:2]
    kv.pool.release(taken)
    kv.check_invariants()


def test_a_preempted_request_rejoins_through_the_cache() -> None:
    """Two requests outgrow the pool; the victim's prefix blocks stay cached, so it
    comes back with computed tokens instead of prefilling from zero."""
    sched = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=2,
                           max_num_batched_tokens=64, enable_prefix_caching=True)
    for rid in ("a", "bb"):  # different ids: different prompts
        sched.add_request(make_request(rid, 16, 12), 0.0)
    admissions: dict[str, list[int]] = {}
    for step in range(200):
        if not sched.has_unfinished():
            break
        out = sched.schedule(float(step))
        for new in out.new_reqs:
            admissions.setdefault(new.req_id, []).append(new.num_computed_tokens)
        sched.update(out, fake_execute(out), float(step))
        sched.check_invariants()
    assert not sched.has_unfinished()
    assert sched.stats.num_preemptions > 0
    rejoined = [counts[1:] for counts in admissions.values() if len(counts) > 1]
    assert rejoined, "a request should have been preempted and readmitted"
    assert all(n > 0 and n % 4 == 0 for counts in rejoined for n in counts)


def test_cold_n_samples_share_the_prompt_blocks() -> None:
    """n = 4 on an empty cache: samples 2-4 find the first one's prompt blocks, published
    when it is admitted, and hold one block of their own each."""
    llm = LLM("tiny", block_size=4, num_kv_blocks=64)
    prompt = list(range(10, 31))  # 21 tokens: 5 full blocks
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(n=4, max_tokens=3, ignore_eos=True))[0]
    assert all(len(c.token_ids) == 3 for c in out.outputs)
    assert llm.stats()["prefix_cache_hits"] == 3 * 20
    assert llm.engine.kv.peak_used_blocks == 5 + 4  # unshared: 4 x 6 blocks


@pytest.mark.parametrize("a, b", [
    (([1, 23, 0, 0], b"m"), ([12, 3, 0, 0], b"m")),  # the same digits, split differently
    (([5, 0, 0, 0], b"m"), ([5 + 2**32, 0, 0, 0], b"m")),  # equal in the low 32 bits
    (([256, 0, 0, 0], b"m"), ([0, 1, 0, 0], b"m")),  # equal as a byte string of uint8
    (([1, 2, 3, 4], b"model-a"), ([1, 2, 3, 4], b"model-b")),  # another model or dtype
])
def test_block_hash_tells_apart_what_a_weak_encoding_would_not(a, b) -> None:
    """Hits are found by hash alone, so the hash is collision-safe (SHA-256 over the
    parent digest, the int64 token ids and the extra key); these inputs would collide
    under a lossy encoding of the token ids or without the extra key."""
    parent = chain_hash(b"", [7, 7, 7, 7], b"")
    assert chain_hash(parent, *a) != chain_hash(parent, *b)
    assert chain_hash(parent, *a) == chain_hash(parent, list(a[0]), a[1])
    assert chain_hash(parent, *a) != chain_hash(chain_hash(b"", [7, 7, 7, 8], b""), *a)
