"""``conveyor router --prefill/--decode`` without processes: the proxy's two requests and
its error mapping over a mock transport; the CLI keeps the two router modes apart; the
simulator's P/D mode moves the bytes it should and computes one prompt token per request
on the decode side."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from conveyor.entrypoints.cli import build_parser
from conveyor.router.disagg import DisaggConfig, build_disagg_app

PRE, DEC = "http://prefill:1", "http://decode:2"


def _proxy(handler, prefill=(PRE,), decode=(DEC,)):
    app = build_disagg_app(DisaggConfig(list(prefill), list(decode)),
                           transport=httpx.MockTransport(handler))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy")


def _post(handler, body, path="/v1/completions"):
    async def go():
        async with _proxy(handler) as c:
            return await c.post(path, json=body)
    return asyncio.run(go())


def test_prefill_then_decode_with_the_handle():
    seen = []

    def handler(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        seen.append((str(req.url), body))
        if req.url.host == "prefill":
            kv = body["kv_transfer_params"]
            assert body["max_tokens"] == 1 and body["stream"] is False and kv["do_remote_decode"]
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": {
                "transfer_id": kv["transfer_id"], "do_remote_prefill": True,
                "remote_host": "127.0.0.1", "remote_port": 9, "num_prompt_tokens": 3}})
        return httpx.Response(200, json={"choices": [{"text": "decoded"}]})

    r = _post(handler, {"model": "m", "prompt": [1, 2, 3], "max_tokens": 20,
                        "stream_options": None})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
    (u1, pre), (u2, dec) = seen
    assert u1 == PRE + "/v1/completions" and u2 == DEC + "/v1/completions"
    assert dec["max_tokens"] == 20 and "stream_options" in dec  # the client's own body
    assert dec["kv_transfer_params"]["transfer_id"] == pre["kv_transfer_params"]["transfer_id"]
    assert dec["kv_transfer_params"]["remote_port"] == 9


def test_chat_caps_max_completion_tokens_on_the_prefill():
    def handler(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        if req.url.host == "prefill":
            assert body["max_completion_tokens"] == 1 and body["max_tokens"] == 1
            return httpx.Response(200, json={"kv_transfer_params": {"transfer_id": "t"}})
        return httpx.Response(200, json={"ok": body["kv_transfer_params"]["transfer_id"]})

    r = _post(handler, {"model": "m", "messages": [], "max_completion_tokens": 9},
              "/v1/chat/completions")
    assert r.json() == {"ok": "t"}


def test_errors_are_openai_errors():
    def prefill_429(req):
        if req.url.host == "prefill":
            return httpx.Response(429, json={"error": {"message": "queue full", "code": "q"}})
        raise AssertionError("no decode after a refused prefill")

    r = _post(prefill_429, {"model": "m", "prompt": "hi"})
    assert r.status_code == 429 and r.json()["error"]["message"] == "queue full"

    def no_handle(req):
        return httpx.Response(200, json={"choices": []})

    r = _post(no_handle, {"model": "m", "prompt": "hi"})
    assert r.status_code == 502 and "kv_transfer_params" in r.json()["error"]["message"]

    def decode_down(req):
        if req.url.host == "prefill":
            return httpx.Response(200, json={"kv_transfer_params": {"transfer_id": "t"}})
        raise httpx.ConnectError("refused", request=req)

    r = _post(decode_down, {"model": "m", "prompt": "hi"})
    assert r.status_code == 502 and r.json()["error"]["code"] == "decode_failed"

    r = _post(no_handle, {"model": "m", "prompt": "hi", "kv_transfer_params": {}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"


def test_unreachable_prefill_sends_the_request_to_decode_without_a_handle():
    def handler(req):
        if req.url.host == "prefill":
            raise httpx.ConnectError("refused", request=req)
        return httpx.Response(200, json={"has_handle": "kv_transfer_params" in
                                         json.loads(req.content)})

    r = _post(handler, {"model": "m", "prompt": "hi"})
    assert r.status_code == 200 and r.json() == {"has_handle": False}


def test_router_modes_exclude_each_other():
    parser = build_parser("router")
    args = parser.parse_args(["router", "--replica", "http://a:1", "--prefill", "http://b:2",
                              "--decode", "http://c:3"])
    with pytest.raises(SystemExit, match="exclude each other"):
        args.func(args)
    args = parser.parse_args(["router", "--prefill", "http://b:2,http://b:3"])
    with pytest.raises(SystemExit, match="at least one --prefill URL and one --decode"):
        args.func(args)


def test_simulator_pd_mode_moves_the_prompt_bytes():
    from conveyor.bench.workload import BenchRequest
    from conveyor.config import EngineArgs
    from conveyor.costs.factory import make_cost_model
    from conveyor.sim.disagg import DisaggSimulator
    from conveyor.sim.model import resolve_sim_model

    args = EngineArgs(model="llama3-8b", load_format="dummy", max_num_seqs=64,
                      max_num_batched_tokens=4096)
    model = resolve_sim_model(args)
    cost = make_cost_model("roofline", model, hardware="h100", tp=1)
    reqs = [BenchRequest(f"r{i}", 0.05 * i, list(range(5, 5 + 300 + 37 * i)), 20, "default",
                         0, None, None) for i in range(12)]
    sim = DisaggSimulator(args, cost, num_prefill=1, num_decode=2, link_bytes_per_s=1e9)
    res = sim.run(reqs)
    assert not res.errors and not res.unfinished and len(res.finished) == 12
    prompt = sum(len(r.prompt_token_ids) for r in reqs)
    assert res.transfer_bytes == model.kv_bytes_per_token * prompt
    assert res.decode_prompt_tokens_computed == len(reqs)  # each its last prompt token
    for r in reqs:
        m = res.finished[r.request_id]
        assert m.num_generation_tokens == 20
        # the client's TTFT includes the transfer at 1 GB/s
        assert m.ttft > model.kv_bytes_per_token * len(r.prompt_token_ids) / 1e9
