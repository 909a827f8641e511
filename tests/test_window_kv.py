"""KV blocks behind the sliding window go back to the pool (a model windowed on every
layer, and a hybrid one's windowed layer group: Gemma 2 and 3): greedy ids still equal
transformers' under batching, chunking, preemption and prefix hits, the pool's free count
shows the blocks returned, and no block a window still reads is ever released (hypothesis
properties over the scheduler and the managers)."""

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


def _needed_blocks(kv: KVCacheManager, first_query: int, end: int,
                   window: int | None = None) -> range:
    """Table indices of the keys queries at positions >= ``first_query`` read, up to
    ``end`` (exclusive): from the first query's window on (the layers' ``window``, by
    default the manager's)."""
    lo = max(0, first_query - (window or kv.sliding_window) + 1)
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

    def check(rid: str, n: int, end: int) -> None:
        held, table = set(kv.held_blocks(rid)), kv.req_blocks[rid]
        for i in _needed_blocks(kv, end - n, end):
            assert table[i] in held and kv.pool.ref_cnt[table[i]] > 0, (rid, i)

    _run_to_the_end(sched, reqs, num_blocks * 4, check)
    assert kv.pool.num_used_blocks == 0


def _run_to_the_end(sched, reqs, max_len: int, check) -> None:
    """Add ``reqs`` ((family, prompt length, output length); a family shares its prefix,
    prompts cut to fit ``max_len``) and step ``sched`` until every request finishes,
    calling ``check(request id, tokens scheduled, the step's last query + 1)`` for every
    scheduled request after each schedule."""
    for i, (family, prompt_len, out_len) in enumerate(reqs):
        prompt_len = min(prompt_len, max_len - out_len - 1)
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
            check(rid, n, sched.requests[rid].num_computed_tokens)
        sched.update(out, fake_execute(out), float(step))
        sched.check_invariants()
    assert not sched.has_unfinished()


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


# ---- hybrid models: a block table per layer group (core/kv_groups.py) ------------------------
def _hybrid(num_full: int = 32, num_window: int = 32, caching: bool = False,
            window: int = WINDOW):
    from conveyor.core.kv_groups import HybridKVCacheManager

    return HybridKVCacheManager(num_full, num_window, 4, window, caching)


def test_a_hybrid_request_keeps_its_context_in_full_layers_and_its_window_in_the_others(
        ) -> None:
    kv = _hybrid()
    req = make_request("a", 40, 60)
    for start in range(0, 40, 16):
        n = min(16, 40 - start)
        assert kv.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
    for _ in range(60):
        req.append_output_token(5)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        kv.check_invariants()
        assert len(kv.windowed.held_blocks("a")) <= 4  # the window (8 keys) + the new block
        assert kv.full.held_blocks("a") == kv.req_blocks["a"]  # whole context
    assert len(kv.window_block_ids("a")) == len(kv.block_ids("a")) == 25
    # The windowed group's blocks went back to its pool as the window passed them.
    assert kv.windowed.num_free_blocks == 32 - len(kv.windowed.held_blocks("a")) >= 28
    assert kv.num_window_freed == 25 - len(kv.windowed.held_blocks("a"))
    assert kv.full.num_free_blocks == 32 - 25
    kv.free("a")
    kv.check_invariants()
    assert kv.free_counts() == (32, 32)


def test_a_hybrid_request_runs_only_where_both_groups_have_room() -> None:
    kv = _hybrid(num_full=32, num_window=3)
    big = make_request("a", 20, 4)  # 5 blocks: the full group has them, the windowed not
    assert kv.allocate_slots(big, 20) is None
    assert kv.free_counts() == (32, 3) and not kv.req_blocks  # neither group allocated
    assert kv.blocks_to_take(big, 20) == (5, 5)
    assert kv.allocate_slots(big, 12) is not None  # a chunk that fits both
    big.num_computed_tokens = 12
    # Its next chunk's first window starts at 5: block 0 (keys 0-3) is released first.
    assert kv.blocks_to_take(big, 4) == (1, 0)
    assert kv.allocate_slots(big, 4) is not None
    assert kv.windowed.held_blocks("a") == kv.window_block_ids("a")[1:]
    kv.check_invariants()


def test_hybrid_prefix_hits_are_the_shorter_of_both_groups() -> None:
    kv = _hybrid(num_full=32, num_window=32, caching=True)
    first = make_request("a", 33, 4)
    kv.allocate_slots(first, 33)
    first.num_computed_tokens = 33
    kv.cache_computed_blocks(first)
    kv.free("a")
    again = make_request("a", 33, 4)
    again.request_id = "b"
    hit = kv.get_computed_blocks(again)
    assert hit.num_tokens == 32
    assert kv.allocate_slots(again, 1, hit) is not None
    # Query 32 reads keys 25..32: the windowed group takes blocks 6..8 of the hit only.
    assert kv.windowed.held_blocks("b") == kv.window_block_ids("b")[6:]
    assert kv.full.held_blocks("b") == kv.block_ids("b")
    kv.check_invariants()
    kv.free("b")
    # The windowed group's first block evicted: a hit can no longer start at block 0.
    kv.windowed.pool.allocate(kv.windowed.num_free_blocks)
    assert kv.get_computed_blocks(again).num_tokens == 0


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40), st.integers(1, 12)),
                min_size=2, max_size=16),
       st.integers(10, 30), st.integers(6, 30), st.integers(1, 12), st.booleans(),
       st.integers(4, 16))
def test_no_block_a_hybrid_layer_reads_is_released(reqs, num_full, num_window, window,
                                                   caching, budget) -> None:
    """Whatever the batch, chunking, preemption and prefix hits: every block of a
    scheduled query's context is held in the full group, every block its window reads in
    the windowed group, and everything comes back at the end."""
    from conveyor.config import SchedulerConfig
    from conveyor.core.scheduler import Scheduler

    kv = _hybrid(num_full, num_window, caching, window)
    max_len = min(num_full, num_window) * 4
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget), kv,
                      max_len)

    def check(rid: str, n: int, end: int) -> None:
        for group, needed in ((kv.full, range(-(-end // 4))),
                              (kv.windowed, _needed_blocks(kv.windowed, end - n, end,
                                                           window))):
            held, table = set(group.held_blocks(rid)), group.req_blocks[rid]
            for i in needed:
                assert table[i] in held and group.pool.ref_cnt[table[i]] > 0, (rid, i)

    _run_to_the_end(sched, reqs, max_len, check)
    assert kv.free_counts() == (num_full, num_window)


def test_kv_groups_split_the_same_bytes() -> None:
    """The windowed pool holds what max_num_seqs windows plus a step's tokens need; the
    bytes it saves go to the full layers' pool; off where the brief says so."""
    import dataclasses

    from conveyor.config.kv_window import kv_groups, kv_groups_off_reason, window_pool_blocks

    llm = LLM(_family_checkpoint("gemma3"), dtype="float32", num_kv_blocks=400,
              block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    config = llm.engine.config
    groups = kv_groups(config)
    assert groups.layer_groups == (1, 0, 1) and groups.window == 12
    assert groups.num_window_blocks == window_pool_blocks(12, 4, 4, 16) == 4 * 5 + 4
    # 400 blocks of 3 layers = full blocks of 1 layer + windowed blocks of 2 layers.
    assert groups.num_full_blocks + 2 * groups.num_window_blocks == 3 * 400
    assert llm.engine.runner.kv_caches[1][0].shape[0] == groups.num_full_blocks * 4
    assert llm.engine.runner.kv_caches[0][0].shape[0] == groups.num_window_blocks * 4
    # Gemma 3's own pattern (5 windowed : 1 global) where config.json lists no layer types.
    six = dataclasses.replace(config, model=dataclasses.replace(
        config.model, num_layers=6,
        hf_config={**config.model.hf_config, "layer_types": None,
                   "sliding_window_pattern": 6}))
    assert kv_groups(six).layer_groups == (1, 1, 1, 1, 1, 0)
    assert kv_groups(six).num_full_blocks + 5 * groups.num_window_blocks == 6 * 400
    cache = config.cache
    for off in (dataclasses.replace(config, device="cuda:0"),
                dataclasses.replace(config, cache=dataclasses.replace(
                    cache, hybrid_kv_groups=False)),
                dataclasses.replace(config, kv_transfer=dataclasses.replace(
                    config.kv_transfer, role="decode"))):
        assert kv_groups(off) is None and kv_groups_off_reason(off) is not None
    assert kv_groups_off_reason(config) is None
    whole = LLM(_family_checkpoint("gemma3"), dtype="float32", num_kv_blocks=400,
                disable_hybrid_kv_cache_manager=True)
    assert type(whole.engine.kv).__name__ == "KVCacheManager"
    assert whole.engine.runner.kv_groups is None


def _family_checkpoint(family: str) -> str:
    from test_families import checkpoint

    return checkpoint(family)  # window 12, three layers: windowed, global, windowed


HYBRID_CONFIGS = {
    "batched": dict(block_size=4),
    "chunked": dict(block_size=4, max_num_batched_tokens=7),
    "preempt": dict(block_size=4, num_kv_blocks=16, max_num_batched_tokens=24),
    # A windowed pool smaller than the full one (2 windows + a step's 8 tokens).
    "small_window_pool": dict(block_size=4, num_kv_blocks=24, max_num_seqs=2,
                              max_num_batched_tokens=8),
    "prefix_hits": dict(block_size=4, num_kv_blocks=96, max_num_seqs=1),
    "sdpa_attention": dict(block_size=4, attention_backend="sdpa", max_num_batched_tokens=20),
    "async_scheduling": dict(block_size=4, num_kv_blocks=24, async_scheduling=True),
    "ngram_speculation": dict(block_size=4, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "adaptive": False}),
}


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
@pytest.mark.parametrize("config", list(HYBRID_CONFIGS))
def test_hybrid_greedy_matches_transformers_with_window_blocks_freed(family: str,
                                                                    config: str) -> None:
    from test_exactness import reference

    path = _family_checkpoint(family)
    prompts = _prompts(3)  # 20 to 52 tokens: longer than the window (12)
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in (20, 3, 14, 9, 24, 1)]
    llm = LLM(path, dtype="float32", **HYBRID_CONFIGS[config])
    assert type(llm.engine.kv).__name__ == "HybridKVCacheManager"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for i, (out, prompt, sp) in enumerate(zip(outs, prompts, params)):
        assert out.outputs[0].token_ids == reference(path, tuple(prompt), sp.max_tokens), \
            f"request {i}"
    stats = llm.stats()
    window = stats["kv_window_group"]
    assert stats["kv_window_freed_blocks"] > 0 and window["blocks_in_use"] == 0
    assert stats["kv_blocks_in_use"] == 0
    if config == "preempt":
        assert stats["num_preemptions"] > 0
    if config == "small_window_pool":
        assert window["num_blocks"] == 2 * 5 + 2 and window["peak_blocks"] <= 12
    if config == "prefix_hits":
        assert stats["prefix_cache_hits"] > 0
