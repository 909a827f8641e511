"""The router's policies and replica bookkeeping without servers: the routing decisions
(hypothesis over loads and caches), the cache index, and the proxy's failure handling on
a mock transport."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.core.kv_cache_manager import chain_hash, prompt_block_hashes, root_hash
from conveyor.router.app import RouterConfig, build_router_app
from conveyor.router.policies import (
    CacheIndex,
    LeastLoaded,
    PrefixAware,
    RoundRobin,
    RoutingRequest,
    make_policy,
)

BS = 4


@dataclass
class FakeReplica:
    num_unfinished: int = 0
    num_active_tokens: int = 0
    cached: set[bytes] = field(default_factory=set)

    def num_cached_tokens(self, request: RoutingRequest) -> int:
        n = 0
        for h in request.block_hashes(BS, b"k"):
            if h not in self.cached:
                break
            n += 1
        return n * BS


def holding(tokens: list[int], n_blocks: int, **kw) -> FakeReplica:
    return FakeReplica(cached=set(prompt_block_hashes(tokens, BS, b"k")[:n_blocks]), **kw)


def test_prompt_block_hashes_are_the_chain_of_chain_hash() -> None:
    tokens = list(range(11))
    parent, want = root_hash(b"salt"), []
    for i in range(2):
        parent = chain_hash(parent, tokens[i * BS:(i + 1) * BS], b"salt")
        want.append(parent)
    assert prompt_block_hashes(tokens, BS, b"salt") == want
    assert prompt_block_hashes(tokens, BS, b"other")[0] != want[0]
    with pytest.raises(ValueError, match="block_size"):
        prompt_block_hashes(tokens, 0, b"")


def test_round_robin_and_least_loaded() -> None:
    rr = RoundRobin()
    reps = [FakeReplica(), FakeReplica(), FakeReplica()]
    assert [rr.choose(RoutingRequest(None), reps) for _ in range(5)] == [0, 1, 2, 0, 1]
    reps = [FakeReplica(3), FakeReplica(1, 50), FakeReplica(1, 10)]
    assert LeastLoaded().choose(RoutingRequest(None), reps) == 2
    with pytest.raises(ValueError, match="no replica"):
        LeastLoaded().choose(RoutingRequest(None), [])
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_policy("random")
    with pytest.raises(ValueError, match="balance_rel"):
        PrefixAware(balance_rel=0.5)


def test_prefix_prefers_the_cache_then_spills_when_overloaded() -> None:
    prompt = list(range(64))
    req = RoutingRequest(prompt)
    policy = PrefixAware(balance_abs=2, balance_rel=1.5)
    # Replica 1 holds 12 of the 16 blocks; same load: it wins.
    reps = [FakeReplica(1, 64), holding(prompt, 12, num_unfinished=1, num_active_tokens=64)]
    assert policy.choose(req, reps) == 1
    # Cost: uncached + (load + uncached). 0: 64 + 128; 1: 16 + 161 + 16 (its load
    # in tokens outweighs what it saves): the other one.
    reps[1].num_active_tokens = 161
    assert policy.choose(req, reps) == 0
    # Within the token weighing but more than 2 requests and 1.5x above the least loaded:
    # overloaded, so it is left out however much it holds.
    reps[1].num_active_tokens, reps[1].num_unfinished = 64, 4
    assert policy.choose(req, reps) == 0
    # The whole prompt unknown (no token ids): the load decides.
    assert policy.choose(RoutingRequest(None, 64), [FakeReplica(2, 9), FakeReplica(2, 5)]) == 1


loads = st.lists(st.tuples(st.integers(0, 30), st.integers(0, 5000), st.integers(0, 20)),
                 min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(loads, st.integers(1, 80), st.integers(0, 10), st.floats(1.0, 3.0))
def test_prefix_choice_is_the_cheapest_replica_not_overloaded(specs, length, abs_gap, rel):
    prompt = list(range(1000, 1000 + length))
    req = RoutingRequest(prompt)
    reps = [holding(prompt, blocks, num_unfinished=u, num_active_tokens=t)
            for u, t, blocks in specs]
    policy = PrefixAware(balance_abs=abs_gap, balance_rel=rel)
    i = policy.choose(req, reps)
    lowest = min(r.num_unfinished for r in reps)
    assert not policy.overloaded(reps[i].num_unfinished, lowest)
    for r in reps:
        if not policy.overloaded(r.num_unfinished, lowest):
            assert policy.cost(req, reps[i]) <= policy.cost(req, r)
    # The cost is uncached tokens plus load: a replica holding the whole prompt at the
    # lowest load in tokens and requests is always a best choice.
    full = holding(prompt, length // BS, num_unfinished=lowest,
                   num_active_tokens=min(r.num_active_tokens for r in reps))
    j = policy.choose(req, [*reps, full])
    assert policy.cost(req, [*reps, full][j]) == policy.cost(req, full)


def test_cache_index_summary_and_routed_blocks_expire() -> None:
    now = [0.0]
    index = CacheIndex(lambda: now[0], hash_bytes=8, recent_ttl_s=10.0)
    chain = prompt_block_hashes(list(range(16)), BS, b"")
    index.replace_summary([chain[0], chain[2]])  # a chain breaks at its first miss
    assert index.num_cached_blocks(chain) == 1
    index.add_routed(chain[:3])
    assert index.num_cached_blocks(chain) == 3
    now[0] = 11.0  # what was routed and never showed up in a summary is forgotten
    index.replace_summary([chain[0]])
    assert index.num_cached_blocks(chain) == 1
    index.clear()
    assert index.num_cached_blocks(chain) == 0


# ---- the proxy on a mock transport ---------------------------------------------------------
def _summary() -> dict:
    return {"block_size": BS, "hash_key": b"k".hex(), "hash_bytes": 8, "block_hashes": [],
            "num_cached_blocks": 0, "num_running": 0, "num_waiting": 0,
            "kv_blocks_in_use": 0, "num_kv_blocks": 64}


def _mock(down: set[str], seen: list[str]) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in down:
            raise httpx.ConnectError("connection refused", request=request)
        seen.append(f"{host} {request.url.path}")
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if request.url.path == "/v1/kv_summary":
            return httpx.Response(200, json=_summary())
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": list(range(9)), "count": 9})
        return httpx.Response(200, json={"served_by": host, "body": json.loads(request.content)})
    return httpx.MockTransport(handle)


def _post(app, path: str, body: dict, down: set[str]) -> httpx.Response:
    """POST through the app, after a health check that finds every replica up; replica
    "a" then dies (refuses connections)."""
    async def go() -> httpx.Response:
        await app.state.router.checker.check_all()  # the ASGI transport runs no lifespan
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            down.add("a")
            return await c.post(path, json=body)
    return asyncio.run(go())


def test_a_failed_connect_takes_the_replica_out_and_the_request_goes_on() -> None:
    down: set[str] = set()
    seen: list[str] = []
    config = RouterConfig(["http://a:1", "http://b:1"], routing="least-loaded")
    app = build_router_app(config, transport=_mock(down, seen))
    resp = _post(app, "/v1/completions", {"prompt": "hi"}, down)
    assert resp.status_code == 200 and resp.json()["served_by"] == "b"
    a, b = app.state.router.replicas
    assert not a.healthy and "connect failed" in a.reason and b.healthy
    assert a.in_flight == b.in_flight == 0


def test_prefix_routing_tokenizes_on_a_replica_and_every_connect_failing_is_a_503() -> None:
    down: set[str] = set()
    seen: list[str] = []
    app = build_router_app(RouterConfig(["http://a:1"], routing="prefix"),
                           transport=_mock(down, seen))
    resp = _post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
                 down)
    assert resp.status_code == 503
    err = resp.json()["error"]
    assert err["code"] == "no_replica_available" and "http://a:1" in err["message"]
    assert "a /v1/kv_summary" in seen


@pytest.mark.parametrize("replicas, match", [
    ([], "at least one"), (["localhost:8000"], "http://"),
    (["http://a:1", "http://a:1"], "twice")])
def test_bad_router_config_is_a_clear_error(replicas, match) -> None:
    with pytest.raises(ValueError, match=match):
        RouterConfig(replicas)


def test_a_failing_summary_leaves_the_replica_in_rotation_and_a_failing_health_not() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200 if request.url.host == "a" else 503, json={})
        return httpx.Response(500, json={"error": {"message": "boom"}})

    app = build_router_app(RouterConfig(["http://a:1", "http://b:1"], routing="prefix"),
                           transport=httpx.MockTransport(handle))
    asyncio.run(app.state.router.checker.check_all())
    a, b = app.state.router.replicas
    assert a.healthy and a.block_size is None  # no summary yet: nothing counted as cached
    assert not b.healthy and b.reason == "/health answered 503"
    with pytest.raises(ValueError, match="malformed"):
        a.apply_summary({"block_size": 16})


def test_a_health_check_that_raises_fails_that_check_only(caplog) -> None:
    """An exception that is not an HTTP error fails that replica's check, loudly; the other
    replica is checked all the same, and the next check that answers puts it back (raised
    out of check_all, it would have ended the checker's task for good)."""
    broken = {"a"}

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host in broken:
            raise RuntimeError("transport bug")
        return httpx.Response(200, json={})

    app = build_router_app(RouterConfig(["http://a:1", "http://b:1"]),
                           transport=httpx.MockTransport(handle))
    checker = app.state.router.checker
    asyncio.run(checker.check_all())
    a, b = app.state.router.replicas
    assert not a.healthy and a.reason == "health check raised RuntimeError: transport bug"
    assert b.healthy
    assert "health check of http://a:1 raised" in caplog.text
    broken.clear()
    asyncio.run(checker.check_all())
    assert a.healthy and a.reason == ""
