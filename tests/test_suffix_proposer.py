"""SuffixDecoding proposer (conveyor.spec.suffix): drafts from the request's own context and
from finished requests, checked against a brute-force reference that counts substrings
directly in the token lists."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.spec.suffix import SuffixProposer, SuffixTrie

# -- brute-force reference -------------------------------------------------------------


def _next_counts(seqs: list[list[int]], u: list[int]) -> Counter[int]:
    """How often each token follows an occurrence of u, over all start positions."""
    c: Counter[int] = Counter()
    m = len(u)
    for s in seqs:
        for i in range(len(s) - m):
            if s[i:i + m] == u:
                c[s[i + m]] += 1
    return c


def _ref_draft(seqs: list[list[int]], ctx: list[int], *, limit: int, max_depth: int,
               min_match: int, min_prob: float, factor: float) -> tuple[list[int], float]:
    n = len(ctx)
    m = min(max_depth, n)
    while m > 0 and not _next_counts(seqs, ctx[n - m:]):
        m -= 1
    if m < min_match:
        return [], 0.0
    cap = min(limit, int(factor * m + 1e-9))
    u = ctx[n - m:]
    draft: list[int] = []
    cum, score = 1.0, 0.0
    while len(draft) < cap:
        c = _next_counts(seqs, u + draft)
        if not c:
            break
        tok, cnt = min(c.items(), key=lambda kv: (-kv[1], kv[0]))
        cum *= cnt / sum(c.values())
        if cum < min_prob:
            break
        draft.append(tok)
        score += cum
    return draft, score


def _reference(ctx: list[int], cached: list[list[int]], *, num_spec: int, k: int,
               max_depth: int = 32, min_prob: float = 0.1, factor: float = 1.0,
               min_match: int = 1) -> list[int]:
    limit = min(k, num_spec)
    if limit <= 0:
        return []
    kw = dict(limit=limit, max_depth=max_depth, min_match=min_match, min_prob=min_prob,
              factor=factor)
    own, own_score = _ref_draft([ctx], ctx, **kw)
    glob, glob_score = _ref_draft(cached, ctx, **kw)
    return glob if glob_score > own_score else own


def _brute_counts(seqs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    c: Counter[tuple[int, ...]] = Counter()
    for s in seqs:
        for i in range(len(s)):
            for j in range(i + 1, min(len(s), i + depth) + 1):
                c[tuple(s[i:j])] += 1
    return dict(c)


def _occurs(pattern: list[int], seq: list[int]) -> bool:
    m = len(pattern)
    return any(seq[i:i + m] == pattern for i in range(len(seq) - m + 1))


def _last(finished: list[list[int]], n: int) -> list[list[int]]:
    """What a FIFO of n finished requests holds."""
    return finished[max(0, len(finished) - n):] if n else []


def _finish(p: SuffixProposer, rid: str, seq: list[int], k: int = 4, step: int = 3) -> None:
    """Run a request through the proposer the way the engine does, then finish it."""
    for end in range(min(step, len(seq)), len(seq) + 1, step):
        p.propose(rid, seq[:end], k)
    p.propose(rid, seq, k)
    p.finish(rid)


# -- hypothesis strategies -------------------------------------------------------------

_params = st.fixed_dictionaries({
    "num_spec": st.integers(1, 6),
    "k": st.integers(0, 8),
    "max_depth": st.integers(1, 8),
    "min_prob": st.sampled_from([0.0, 0.1, 0.3, 0.5, 0.6]),
    "factor": st.sampled_from([0.5, 1.0, 2.0]),
    "min_match": st.integers(0, 3),
    "max_cached": st.integers(0, 3),
})


def _tokens(vocab: int, max_size: int = 40) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, vocab - 1), max_size=max_size)


def _make(prm: dict) -> SuffixProposer:
    return SuffixProposer(prm["num_spec"], max_depth=prm["max_depth"],
                          max_cached_requests=prm["max_cached"], min_token_prob=prm["min_prob"],
                          max_spec_factor=prm["factor"], min_match=prm["min_match"])


def _ref(prm: dict, ctx: list[int], cached: list[list[int]]) -> list[int]:
    return _reference(ctx, cached, num_spec=prm["num_spec"], k=prm["k"],
                      max_depth=prm["max_depth"], min_prob=prm["min_prob"],
                      factor=prm["factor"], min_match=prm["min_match"])


# -- behaviour -------------------------------------------------------------------------


def test_a_repeated_pattern_in_the_prompt_is_continued() -> None:
    p = SuffixProposer(4)
    assert p.propose("r", [5, 6, 7, 8] * 4, 4) == [5, 6, 7, 8]
    assert p.propose("r", [5, 6, 7, 8] * 4 + [5], 4) == [6, 7, 8, 5]
    # No repeat anywhere: nothing to propose.
    assert SuffixProposer(4).propose("s", list(range(20)), 4) == []


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 12])
def test_the_draft_length_grows_with_the_match(m: int) -> None:
    pattern = list(range(100, 120))
    ctx = [1, *pattern, 2, 3, *pattern[:m]]  # the suffix pattern[:m] matches exactly m tokens
    assert SuffixProposer(8).propose("r", ctx, 8) == pattern[m:m + min(8, m)]
    assert SuffixProposer(8).propose("r", ctx, 3) == pattern[m:m + min(3, m)]  # k bounds it
    assert SuffixProposer(4).propose("r", ctx, 10) == pattern[m:m + min(4, m)]  # so does n
    half = SuffixProposer(8, max_spec_factor=0.5).propose("r", ctx, 8)
    assert half == pattern[m:m + min(8, m // 2)]


def test_min_match_and_max_depth_bound_the_match() -> None:
    pattern = list(range(100, 120))
    ctx = [1, *pattern, 2, 3, *pattern[:2]]
    assert SuffixProposer(8, min_match=3).propose("r", ctx, 8) == []
    assert SuffixProposer(8, min_match=2).propose("r", ctx, 8) == pattern[2:4]
    ctx = [1, *pattern, 2, 3, *pattern[:10]]
    # A match capped at 4 tokens earns a 4-token draft, not 8.
    assert SuffixProposer(8, max_depth=4).propose("r", ctx, 8) == pattern[10:14]


def test_low_probability_tokens_stop_the_draft_and_ties_go_to_the_smallest_id() -> None:
    ctx = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]  # after (1, 2): 3, 4, 5 once each
    assert SuffixProposer(4, min_token_prob=0.3).propose("r", ctx, 4) == [3, 1]
    assert SuffixProposer(4, min_token_prob=0.5).propose("r", ctx, 4) == []
    ctx = [1, 2, 9, 1, 2, 4, 1, 2]
    assert SuffixProposer(4).propose("r", ctx, 1) == [4]
    assert SuffixProposer(4, min_token_prob=0.5).propose("r", ctx, 1) == [4]  # 1/2 is enough


def test_a_tie_left_by_an_eviction_goes_to_the_smallest_id() -> None:
    p = SuffixProposer(4, max_cached_requests=3)
    for i, seq in enumerate([[1, 2, 5], [1, 2, 5], [1, 2, 4]]):
        _finish(p, f"r{i}", seq)
    assert p.propose("q", [7, 1, 2], 4) == [5]  # after (1, 2): 5 twice, 4 once
    _finish(p, "r3", [9])  # evicts the first [1, 2, 5]: 5 once, 4 once
    assert p.propose("q", [7, 1, 2], 4) == [4]


def test_a_finished_request_is_reused_by_a_new_one() -> None:
    p = SuffixProposer(3)
    a = list(range(50, 60)) + list(range(60, 80))  # prompt + output
    b = [7, 8, 9, 60, 61, 62]  # ends with a prefix of a's output
    assert p.propose("b0", b, 3) == []  # nothing finished yet
    _finish(p, "a", a)
    assert p.stats()["cached_requests"] == 1
    assert p.propose("b", b, 3) == [63, 64, 65]
    # A request already running sees it too (its global match is refreshed).
    assert p.propose("b0", b, 3) == [63, 64, 65]
    assert p.propose("b0", [*b, 63], 3) == [64, 65, 66]
    # With no cache, nothing is kept.
    q = SuffixProposer(3, max_cached_requests=0)
    _finish(q, "a", a)
    assert q.propose("b", b, 3) == [] and q.stats()["global_size"] == 0


def test_the_draft_with_the_higher_expected_accepted_length_wins() -> None:
    p = SuffixProposer(4)
    ctx = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]
    assert p.propose("r", ctx, 4) == [3, 1]  # own: 1/3 + 1/3
    _finish(p, "g", [9, 1, 2, 7, 7])
    assert p.propose("r", ctx, 4) == [7, 7]  # global: 1 + 1
    ctx2 = [1, 2, 8, 8, 8, 8, 0, 1, 2]
    assert p.propose("s", ctx2, 4) == [8, 8]  # own (1 + 1) ties global (1 + 1): own kept
    _finish(p, "h", [1, 2, 6])  # global after (1, 2): 6 or 7, then 6 ends its request
    assert p.propose("s", ctx2, 4) == [8, 8]  # own 2 beats global 1/2
    assert p.propose("r", ctx, 4) == [3, 1]  # own 2/3 beats global 1/2


def test_k_zero_and_no_speculative_tokens_give_nothing() -> None:
    ctx = [5, 6, 7, 8] * 4
    p = SuffixProposer(4)
    assert p.propose("r", ctx, 0) == []
    assert p.propose("r", ctx, -1) == []
    assert p.propose("r", ctx, 2) == [5, 6]  # the k=0 calls still ingested the context
    assert SuffixProposer(0).propose("r", ctx, 4) == []


def test_eviction_keeps_the_global_tree_bounded_and_removes_everything() -> None:
    rng = random.Random(0)
    p = SuffixProposer(4, max_depth=8, max_cached_requests=3)
    window = 8 + 4
    seqs = []
    for i in range(40):
        seq = [rng.randrange(6) for _ in range(rng.randrange(1, 60))]
        seqs.append(seq)
        _finish(p, f"r{i}", seq)
        s = p.stats()
        assert s["cached_requests"] == min(i + 1, 3)
        assert s["cached_tokens"] == sum(len(x) for x in seqs[-3:])
        assert s["global_size"] <= sum(len(x) for x in seqs[-3:]) * window
        assert s["active_requests"] == 0
    for i in range(3):  # three empty requests push every real one out
        _finish(p, f"empty{i}", [])
    s = p.stats()
    assert s["global_size"] == s["global_nodes"] == s["global_leaves"] == 0
    assert s["cached_tokens"] == 0
    assert p.propose("x", seqs[-1], 4) == _reference(seqs[-1], [], num_spec=4, k=4, max_depth=8)


@given(st.integers(3, 6).flatmap(lambda v: st.lists(_tokens(v), min_size=1, max_size=6)),
       st.integers(1, 6), st.randoms(use_true_random=False))
@settings(max_examples=150, deadline=None)
def test_the_trie_counts_exactly_and_eviction_removes_exactly(
        seqs: list[list[int]], depth: int, rnd: random.Random) -> None:
    trie = SuffixTrie(depth)
    for s in seqs:
        trie.insert(s)
    assert trie.counts() == _brute_counts(seqs, depth)
    left = list(range(len(seqs)))
    rnd.shuffle(left)
    while left:
        trie.remove(seqs[left.pop()])
        assert trie.counts() == _brute_counts([seqs[i] for i in sorted(left)], depth)
    assert len(trie) == 0 and trie.counts() == {}


@given(st.integers(3, 6).flatmap(_tokens), st.integers(1, 6))
@settings(max_examples=100, deadline=None)
def test_a_growing_sequence_is_counted_exactly_at_every_step(seq: list[int], depth: int) -> None:
    trie = SuffixTrie(depth)
    grown: list[int] = []
    active = [trie.root]
    for pos, tok in enumerate(seq):
        grown.append(tok)
        active = trie.extend(active, grown, pos)
        assert trie.counts() == _brute_counts([grown], depth)


# -- properties ------------------------------------------------------------------------

@given(_params, st.integers(3, 6).flatmap(lambda v: st.tuples(
    _tokens(v, 60), st.lists(_tokens(v, 30), max_size=4),
    st.lists(st.tuples(st.sampled_from(["append", "finish"]), st.integers(1, 5)),
             max_size=20))))
@settings(max_examples=200, deadline=None)
def test_incremental_updates_propose_what_a_fresh_proposer_does(prm: dict, data) -> None:
    ctx_all, others, events = data
    inc = _make(prm)
    finished: list[list[int]] = []
    ctx: list[int] = []
    others = list(others)
    for kind, amount in [("append", 1), *events]:
        if kind == "finish":
            if not others:
                continue
            seq = others.pop()
            _finish(inc, f"o{len(finished)}", seq, prm["k"], amount)
            finished.append(seq)
        else:
            ctx = ctx_all[:len(ctx) + amount]
        got = inc.propose("r", ctx, prm["k"])
        fresh = _make(prm)
        for i, seq in enumerate(finished):
            _finish(fresh, f"o{i}", seq, prm["k"], len(seq) or 1)
        assert got == fresh.propose("r", ctx, prm["k"])
        cached = _last(finished, prm["max_cached"])
        assert got == _ref(prm, ctx, cached)


@given(_params, st.integers(3, 6).flatmap(lambda v: st.tuples(
    _tokens(v, 60), st.lists(_tokens(v, 40), max_size=4))))
@settings(max_examples=200, deadline=None)
def test_every_draft_occurs_after_the_matched_suffix(prm: dict, data) -> None:
    ctx, finished = data
    p = _make(prm)
    for i, seq in enumerate(finished):
        _finish(p, f"o{i}", seq)
    cached = _last(finished, prm["max_cached"])
    for end in range(len(ctx) + 1):
        cur = ctx[:end]
        draft = p.propose("r", cur, prm["k"])
        assert len(draft) <= min(prm["k"], prm["num_spec"])
        if not draft:
            continue
        lo = max(1, prm["min_match"])
        assert any(_occurs(cur[end - m:] + draft, s)
                   for m in range(lo, min(prm["max_depth"], end) + 1)
                   for s in [cur, *cached])


@given(_params, st.integers(3, 6).flatmap(lambda v: st.tuples(
    _tokens(v, 50), st.lists(_tokens(v, 30), max_size=3),
    st.lists(st.tuples(st.booleans(), st.integers(0, 50), _tokens(v, 8)), max_size=8))))
@settings(max_examples=150, deadline=None)
def test_a_shrunk_or_rewritten_context_is_rebuilt(prm: dict, data) -> None:
    ctx, finished, edits = data
    p = _make(prm)
    for i, seq in enumerate(finished):
        _finish(p, f"o{i}", seq)
    cached = _last(finished, prm["max_cached"])
    assert p.propose("r", ctx, prm["k"]) == _ref(prm, ctx, cached)
    for grow, cut, tail in edits:
        if grow:  # an ordinary extension
            new = ctx + tail
        else:  # preemption: cut back, recomputed differently, never longer than before
            new = (ctx[:min(cut, max(len(ctx) - 1, 0))] + tail)[:max(len(ctx) - 1, 0)]
        ctx = new
        assert p.propose("r", ctx, prm["k"]) == _ref(prm, ctx, cached)


def test_a_rewritten_last_token_is_detected() -> None:
    p = SuffixProposer(4)
    ctx = [1, 2, 3, 4, 9, 1, 2, 3]
    assert p.propose("r", ctx, 4) == [4, 9, 1]  # a 3-token match earns 3 tokens
    rewritten = [1, 2, 3, 4, 9, 1, 2, 7, 1, 2, 7]  # same prefix up to 2, then recomputed
    assert p.propose("r", rewritten, 4) == SuffixProposer(4).propose("r", rewritten, 4)
    assert p.propose("r", [1, 2, 3], 4) == []  # shrunk: no earlier (1, 2, 3)
    assert p.propose("r", [1, 2, 3, 1, 2], 4) == [3, 1]


def test_finishing_queues_and_the_next_proposal_pays_a_bounded_share() -> None:
    """A request's end only queues its tokens (nothing is paid while nobody proposes, and
    what the FIFO would evict unseen is dropped); a proposal inserts at most
    FLUSH_TOKENS_PER_DRAFT of them per draft it asks for (a long backlog is paid over
    several proposals)."""
    p = SuffixProposer(4, max_depth=4, max_cached_requests=3)
    seqs = [[i, i + 1, i + 2] * 200 for i in range(0, 50, 5)]  # 600 tokens each
    for i, seq in enumerate(seqs):
        p.propose(f"r{i}", seq, 4)  # all running at once
    for i in range(len(seqs)):
        p.finish(f"r{i}")  # then all end, with no proposal in between
    assert len(p._pending) == 3 and p._global.num_nodes == 0  # the newest three, queued
    p.FLUSH_TOKENS_PER_DRAFT = 500
    p.propose("x", [1, 2], 2)  # 2 drafts: 1,000 tokens
    assert len(p._cached) == 2 and len(p._pending) == 1  # 601 + 601 >= 1000: two went in
    p.propose("x", [1, 2, 3], 2)
    assert len(p._cached) == 3 and not p._pending
    fresh = SuffixProposer(4, max_depth=4, max_cached_requests=3)
    for i, seq in enumerate(seqs[-3:]):
        _finish(fresh, f"r{i}", seq)
    fresh.stats()
    assert p._global.counts() == fresh._global.counts()


def test_a_step_of_proposals_pays_the_upkeep_once_within_its_budget() -> None:
    """``propose_batch`` (one step) inserts at most FLUSH_TOKENS_PER_STEP queued tokens
    (one sequence at least), however many drafts its requests ask for: a probe of 16
    drafts paid 16 x 256 inserts, ~16 ms on code text. Its drafts are ``propose``'s."""
    from conveyor.spec.proposers import ProposeItem

    p = SuffixProposer(4, max_depth=4, max_cached_requests=10)
    seqs = [[i, i + 1, i + 2] * 100 for i in range(0, 50, 5)]  # 300 tokens each
    for i, seq in enumerate(seqs):
        p.propose(f"done{i}", seq, 4)  # all running at once
    for i in range(len(seqs)):
        p.finish(f"done{i}")
    assert len(p._pending) == 10
    p.FLUSH_TOKENS_PER_STEP = 700
    items = [ProposeItem(f"x{j}", [1, 2, 3, 1, 2], 4, []) for j in range(4)]
    out = p.propose_batch(items)
    assert len(p._cached) == 3 and len(p._pending) == 7  # 301 x 3 >= 700: three went in
    ref = SuffixProposer(4, max_depth=4, max_cached_requests=10)
    for i, seq in enumerate(seqs[:3]):
        _finish(ref, f"done{i}", seq)
    ref.stats()
    assert out == {it.req_id: ref.propose(it.req_id, it.token_ids, 4) for it in items}


def test_the_global_tree_takes_finished_outputs_not_prompts() -> None:
    """Told the prompt's length (the runner's ProposeItem), a finished request's outputs
    go into the global tree and its prompt does not; its own tree held both."""
    from conveyor.spec.proposers import ProposeItem

    prompt, output = [7, 8, 9, 7, 8], [1, 2, 3, 1, 2, 3]
    p = SuffixProposer(4, max_depth=4)
    for end in range(len(prompt), len(prompt) + len(output) + 1):
        p.propose_batch([ProposeItem("r", prompt + output[:end - len(prompt)], 4, [],
                                     num_prompt_tokens=len(prompt))])
    p.finish("r")
    assert p.stats()["cached_tokens"] == len(output)
    ref = SuffixTrie(p._depth)
    ref.insert(output)
    assert p._global.counts() == ref.counts()
    assert p.propose("x", [7, 8], 4) == []  # the prompt's text: not in the global tree
    assert p.propose("y", [1, 2], 4)[:1] == [3]  # the outputs' are


# -- the native backend (Arctic Inference's trees), where installed ----------------------

def _native(num_spec: int = 4, **kw):
    pytest.importorskip("arctic_inference.suffix_decoding")
    from conveyor.spec.suffix_native import NativeSuffixProposer

    return NativeSuffixProposer(num_spec, **kw)


def test_native_trees_draft_what_followed_the_match() -> None:
    """Its own tree (prompt and outputs) gives the continuation of the longest match;
    a finished request's outputs, not its prompt, serve the next request; a token list
    that does not extend what it saw starts the request over."""
    from conveyor.spec.proposers import ProposeItem

    p = _native(4, max_depth=8)
    prompt = [5, 6, 7, 8, 9, 5, 6, 7]
    # a match of 3 tokens (5, 6, 7): 3 drafts at most (max_spec_factor 1), k caps them too
    assert p.propose("a", prompt, 4, num_prompt_tokens=len(prompt)) == [8, 9, 5]
    assert p.propose("a", prompt, 2, num_prompt_tokens=len(prompt)) == [8, 9]
    out = [1, 2, 3, 4, 1, 2, 3, 4]
    p.propose_batch([ProposeItem("a", prompt + out, 4, [], num_prompt_tokens=len(prompt))])
    p.finish("a")
    assert p.propose("b", [40, 1, 2], 4, num_prompt_tokens=3)[:2] == [3, 4]  # a's outputs
    assert p.propose("c", [41, 5, 6], 4, num_prompt_tokens=3) == []  # not a's prompt
    assert p.propose("b", [40, 9, 9, 9, 9], 4, num_prompt_tokens=3)[:1] == [9]  # started over
    assert p.stats()["active_requests"] == 2 and p.stats()["cached_requests"] >= 1


def test_native_suffix_backend_is_chosen_by_config() -> None:
    pytest.importorskip("arctic_inference.suffix_decoding")
    from conveyor.config import SpeculativeConfig
    from conveyor.spec.proposers import make_proposer
    from conveyor.spec.suffix_native import NativeSuffixProposer

    def inner(backend: str):
        return make_proposer(SpeculativeConfig("suffix", suffix_backend=backend)).inner

    assert isinstance(inner("native"), NativeSuffixProposer)
    assert isinstance(inner("auto"), NativeSuffixProposer)
    assert isinstance(inner("python"), SuffixProposer)


def test_a_native_backend_that_is_not_installed_is_a_clear_error(monkeypatch) -> None:
    import conveyor.spec.suffix_native as native
    from conveyor.config import SpeculativeConfig
    from conveyor.spec.proposers import make_proposer

    monkeypatch.setattr(native, "native_suffix_available", lambda: False)
    with pytest.raises(ValueError, match="arctic"):
        make_proposer(SpeculativeConfig("suffix", suffix_backend="native"))
    assert isinstance(make_proposer(SpeculativeConfig("suffix")).inner, SuffixProposer)
    with pytest.raises(ValueError, match="suffix_backend"):
        SpeculativeConfig("suffix", suffix_backend="c++")


@given(_params, st.integers(3, 6).flatmap(lambda v: st.tuples(
    _tokens(v, 60), st.lists(_tokens(v, 40), max_size=4),
    st.lists(st.tuples(st.integers(0, 60), _tokens(v, 6)), max_size=4))))
@settings(max_examples=150, deadline=None)
def test_native_drafts_continue_a_suffix_seen_before(prm: dict, data) -> None:
    """Whatever the parameters, every native draft continues a suffix of the context
    (up to max_depth tokens) as some text it was shown did: the request's own, or the
    requests' before it; and a shrunk or rewritten context (preemption) starts the
    request over instead of failing."""
    ctx, finished, rewrites = data
    p = _native(prm["num_spec"], max_depth=prm["max_depth"],
                max_cached_requests=prm["max_cached"], min_token_prob=prm["min_prob"],
                max_spec_factor=prm["factor"])
    for i, seq in enumerate(finished):
        for end in range(1, len(seq) + 1):
            p.propose(f"o{i}", seq[:end], prm["k"])
        p.finish(f"o{i}")
    seen = [s for s in finished if s]
    contexts = [ctx[:end] for end in range(len(ctx) + 1)]
    for cut, tail in rewrites:  # then cut back and recomputed otherwise
        contexts.append(ctx[:cut] + tail)
    for cur in contexts:
        draft = p.propose("r", cur, prm["k"])
        assert len(draft) <= min(prm["k"], prm["num_spec"])
        if draft:
            assert any(_occurs(cur[len(cur) - m:] + draft, s)
                       for m in range(1, min(prm["max_depth"], len(cur)) + 1)
                       for s in [cur, *seen])
    p.finish("r")
    assert p.stats()["active_requests"] == 0
