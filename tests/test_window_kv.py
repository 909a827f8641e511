"""KV blocks behind the sliding window go back to the pool (a model windowed on every
layer): greedy ids still equal transformers' under chunking, preemption and prefix hits,
the pool's free count shows the blocks returned, and no block a window still reads is
ever released (a hypothesis property over the scheduler and the manager)."""

from __future__ import annotations

import random
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import LLM, SamplingParams
from conveyor.config.kv_window import model_kv_window
from conveyor.core.kv_cache_manager import KVCacheManager

from helpers import fake_execute, hf_greedy, make_checkpoint, make_request

WINDOW = 8  # a Mistral checkpoint windowed on every layer, shorter than every prompt


def _needed_blocks(kv: KVCacheManager, first_query: int, end: int) -> range:
    """Table indices of the keys queries at positions >= ``first_query`` read, up to
    ``end`` (exclusive): from the first query's window on."""
    lo = max(0, first_query - kv.sliding_window + 1)
    return range(lo // kv.block_size, -(-end // kv.block_size))


# ---- the manager ---------------------------------------------------------------------------
def test_a_decoding_request_holds_only_its_window() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=4, sliding_window=WINDOW)
    req = make_request("a", 40, 60)
    for start in range(0, 40, 16):  # chunked prefill, 16 tokens a step
        n = min(16, 40 - start)
        assert kv.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
    free_after_prefill = kv.num_free_blocks
    for _ in range(60):  # decode: one token a step
        req.append_output_token(5)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        kv.check_invariants()
        # The window (8 keys) spans at most 3 blocks of 4, plus the block being written.
        assert len(kv.held_blocks("a")) <= 4
    assert kv.num_free_blocks >= free_after_prefill
    assert kv.num_window_freed == len(kv.req_blocks["a"]) - len(kv.held_blocks("a")) > 20
    kv.free("a")
    kv.check_invariants()
    assert kv.num_free_blocks == 32


def test_without_a_window_every_block_is_held() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=4)
    req = make_request("a", 40, 8)
    kv.allocate_slots(req, 40)
    req.num_computed_tokens = 40
    kv.allocate_slots(req, 1)
    assert kv.held_blocks("a") == kv.req_blocks["a"] and kv.num_window_freed == 0


def test_prefix_hits_behind_the_window_are_not_taken() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=True,
                        sliding_window=WINDOW)
    first = make_request("a", 33, 4)
    kv.allocate_slots(first, 33)
    first.num_computed_tokens = 33
    kv.cache_computed_blocks(first)
    again = make_request("a", 33, 4)
    again.request_id = "b"
    hit = kv.get_computed_blocks(again)
    assert hit.num_tokens == 32
    used = kv.pool.num_used_blocks
    assert kv.allocate_slots(again, 1, hit) is not None
    # Query 32 reads keys 25..32: blocks 6..8; blocks 0..5 of the hit are not taken.
    assert kv.held_blocks("b") == kv.req_blocks["b"][6:]
    assert kv.pool.num_used_blocks == used + 1  # only the block for token 32 is new
    kv.check_invariants()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40), st.integers(1, 12)),
                min_size=2, max_size=16),
       st.integers(10, 30), st.integers(1, 12), st.booleans(), st.integers(4, 16))
def test_no_block_a_window_reads_is_released(reqs, num_blocks, window, caching,
                                             budget) -> None:
    """Whatever the batch, chunking, preemption and prefix hits: every block a scheduled
    query's window reads is held by its request through the step (reference counts equal
    holders), and everything comes back at the end."""
    from conveyor.config import SchedulerConfig
    from conveyor.core.scheduler import Scheduler

    kv = KVCacheManager(num_blocks, 4, caching, sliding_window=window)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget), kv,
                      num_blocks * 4)
    for i, (family, prompt_len, out_len) in enumerate(reqs):
        prompt_len = min(prompt_len, num_blocks * 4 - out_len - 1)
        if prompt_len < 1:
            continue
        req = make_request(f"f{family}", prompt_len, out_len)  # same family: same prefix
        req.request_id = f"r{i}"
        sched.add_request(req, 0.0)
    for step in range(3000):
        if not sched.has_unfinished():
            break
        out = sched.schedule(float(step))
        sched.check_invariants()
        for rid, n in out.num_scheduled_tokens.items():
            req = sched.requests[rid]
            end = req.num_computed_tokens  # the step's last query + 1
            held = set(kv.held_blocks(rid))
            table = kv.req_blocks[rid]
            for i in _needed_blocks(kv, end - n, end):
                assert table[i] in held and kv.pool.ref_cnt[table[i]] > 0, (rid, i)
        sched.update(out, fake_execute(out), float(step))
        sched.check_invariants()
    assert not sched.has_unfinished()
    assert kv.pool.num_used_blocks == 0


def test_the_window_freed_is_the_one_every_layer_has() -> None:
    """config/kv_window.py frees behind a window only where the decoder gives every layer
    that window (the family's own rule, model/models/decoder.py)."""
    from conveyor.model.models.decoder import layer_windows
    from conveyor.model.models.registry import FAMILIES, model_class

    hfs = [{}, {"sliding_window": 16}, {"sliding_window": 16, "use_sliding_window": True},
           {"sliding_window": 16, "use_sliding_window": False},
           {"sliding_window": 16, "layer_types": ["sliding_attention"] * 4},
           {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"] * 2},
           {"sliding_window": 16, "use_sliding_window": True, "sliding_window_pattern": 2}]
    for arch in FAMILIES:
        cls = model_class(arch)
        for hf in hfs:
            windows = layer_windows(hf, 4, cls.traits.sliding_window, cls.layer_types(hf, 4))
            want = windows[0] if len(set(windows)) == 1 else None
            model = types.SimpleNamespace(architecture=arch, hf_config=hf, num_layers=4)
            assert model_kv_window(model) == want, (arch, hf, windows)


# ---- against transformers --------------------------------------------------------------------
def _prompts(seed: int, n: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    base = [rng.randrange(4, 384) for _ in range(40)]
    return [base[:rng.randint(20, 40)] + [rng.randrange(4, 384)
                                          for _ in range(rng.randint(0, 12))]
            for _ in range(n)]


CONFIGS = {
    "chunked": dict(block_size=4, max_num_batched_tokens=7),
    "preempt": dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=24),
    "prefix_hits": dict(block_size=4, num_kv_blocks=96, max_num_seqs=1),
    "sdpa_attention": dict(block_size=4, attention_backend="sdpa", max_num_batched_tokens=20),
    # Step n+1 scheduled (its blocks released) while step n runs.
    "async_scheduling": dict(block_size=4, num_kv_blocks=24, async_scheduling=True),
    # Drafts verified past the window, rejected ones rolled back.
    "ngram_speculation": dict(block_size=4, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "adaptive": False}),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_transformers_with_blocks_freed(config: str) -> None:
    path = make_checkpoint("mistral", sliding_window=WINDOW)
    prompts = _prompts(3)
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in (20, 3, 14, 9, 24, 1)]
    llm = LLM(path, dtype="float32", **CONFIGS[config])
    assert llm.engine.kv.sliding_window == WINDOW
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for i, (out, prompt, sp) in enumerate(zip(outs, prompts, params)):
        want = hf_greedy(path, prompt, sp.max_tokens)
        assert out.outputs[0].token_ids == want, f"request {i}"
    stats = llm.stats()
    assert stats["kv_window_freed_blocks"] > 0 and stats["kv_blocks_in_use"] == 0
    if config == "preempt":
        assert stats["num_preemptions"] > 0
    if config == "prefix_hits":
        assert stats["prefix_cache_hits"] > 0


def test_draft_models_and_kv_transfer_keep_whole_contexts() -> None:
    import dataclasses

    from conveyor.config.kv_window import kv_free_window

    llm = LLM(make_checkpoint("mistral", sliding_window=WINDOW), dtype="float32",
              num_kv_blocks=32)
    config = llm.engine.config
    assert kv_free_window(config) == WINDOW
    off = dataclasses.replace(config, cache=dataclasses.replace(config.cache,
                                                                free_outside_window=False))
    assert kv_free_window(off) is None
    transfer = dataclasses.replace(config, kv_transfer=dataclasses.replace(
        config.kv_transfer, role="decode"))
    assert kv_free_window(transfer) is None
