"""Automatic prefix caching: exact outputs, eviction, preemption, invariants."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import LLM, SamplingParams

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
    got_on = [o.outputs[0].token_ids for o in on.generate(inputs, params)]
    got_on2 = [o.outputs[0].token_ids for o in on.generate(inputs, params)]  # warm cache
    got_off = [o.outputs[0].token_ids for o in off.generate(inputs, params)]
    want = [hf_greedy(path, p, 10) for p in prompts]
    assert got_on == want and got_on2 == want and got_off == want
    stats = on.stats()
    assert stats["prefix_cache_hits"] > 0
    assert stats["num_preemptions"] > 0 or on.engine.kv.pool.num_evictions > 0
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
                assert block.ref_cnt > 0
                if block.block_hash is not None:
                    assert pool.lookup(block.block_hash) is block
        assert pool.num_free_blocks + pool.num_used_blocks == num_blocks
    assert not sched.has_unfinished()
