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
