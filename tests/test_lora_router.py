"""Adapter affinity in the data-parallel router (on a mock transport): a request whose
model names an adapter goes to the replicas that list it in /v1/models; the base model's
requests, and an adapter no replica has, go by the policy over all of them."""

from __future__ import annotations

import asyncio
import json

import httpx

from conveyor.router.app import RouterConfig, build_router_app
from conveyor.router.policies import serving_model

MODELS = {"a": ["base", "sql"], "b": ["base"], "c": ["base", "chat", "sql"]}


def handle(request: httpx.Request) -> httpx.Response:
    host = request.url.host
    if request.url.path == "/health":
        return httpx.Response(200, json={"status": "ok"})
    if request.url.path == "/v1/models":
        return httpx.Response(200, json={"object": "list", "data": [
            {"id": m, "object": "model"} for m in MODELS[host]]})
    return httpx.Response(200, json={"served_by": host, "body": json.loads(request.content)})


def served_by(models: list[str]) -> list[str]:
    app = build_router_app(RouterConfig(["http://a:1", "http://b:1", "http://c:1"],
                                        routing="round-robin"),
                           transport=httpx.MockTransport(handle))

    async def go() -> list[str]:
        await app.state.router.checker.check_all()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            out = []
            for model in models:
                r = await c.post("/v1/completions", json={"model": model, "prompt": "hi"})
                out.append(r.json()["served_by"])
            return out
    return asyncio.run(go())


def test_adapter_requests_go_where_the_adapter_is_loaded():
    assert set(served_by(["chat"] * 4)) == {"c"}
    assert set(served_by(["sql"] * 6)) == {"a", "c"}
    assert set(served_by(["base"] * 6)) == {"a", "b", "c"}
    assert set(served_by(["nobody-has-it"] * 6)) == {"a", "b", "c"}


def test_serving_model_keeps_all_without_a_match():
    class R:
        def __init__(self, models):
            self.models = frozenset(models)

    rs = [R(["x"]), R(["y"])]
    assert serving_model(rs, "y") == [rs[1]]
    assert serving_model(rs, None) == rs and serving_model(rs, "z") == rs


def test_prefix_scores_of_an_adapter_use_its_salt():
    """The router hashes an adapter's prompt as the replica's prefix cache keys it (salted
    with the replica's id for the adapter, from its kv_summary's ``lora_ids``): blocks the
    replica cached for adapter ``sql`` count for ``sql``'s requests only, not the base
    model's, and not on a replica where ``sql`` has another id."""
    from conveyor.config.lora import LoRARequest
    from conveyor.core.kv_cache_manager import KVCacheManager
    from conveyor.request import Request
    from conveyor.router.health import Replica
    from conveyor.router.policies import RoutingRequest
    from conveyor.sampling_params import SamplingParams

    salt, block = b"model-salt", 4
    prompt = list(range(10, 27))  # 4 full blocks
    kv = KVCacheManager(16, block, enable_prefix_caching=True, extra_hash_key=salt)
    req = Request("r", prompt, SamplingParams(max_tokens=1), 0.0, max_tokens=1,
                  lora_request=LoRARequest("sql", 2, "/a/sql"))
    assert kv.allocate_slots(req, len(prompt)) is not None
    kv.cache_computed_blocks(req, len(prompt))
    summary = {"block_size": block, "hash_key": salt.hex(), "hash_bytes": 8,
               "block_hashes": [h[:8].hex() for h in kv.pool.cached_hashes(100)],
               "num_running": 0, "num_waiting": 0, "kv_blocks_in_use": 0}

    def cached(model: str | None, lora_ids: dict[str, int]) -> int:
        replica = Replica("http://a:1")
        replica.apply_summary({**summary, "lora_ids": lora_ids})
        return replica.num_cached_tokens(RoutingRequest(prompt, model=model))

    assert cached("sql", {"sql": 2}) == 16
    assert cached("base", {"sql": 2}) == 0 and cached(None, {"sql": 2}) == 0
    assert cached("sql", {"sql": 5}) == 0  # another replica's id for it
    assert cached("sql", {}) == 0  # a replica without it
