"""Multi-LoRA over HTTP (the app in-process around a thread engine): the request's model
names the adapter, /v1/models lists adapters with the base as parent, adapters load and
unload at run time, bad input is 400/404, and an unloaded adapter's in-flight requests
finish with it."""

from __future__ import annotations

import asyncio

import pytest
from lora_helpers import make_adapter, peft_greedy

from helpers import make_checkpoint
from test_server_app import app_client

pytest.importorskip("peft")

PROMPT = [5, 17, 33, 8, 91, 4, 60]


def body(model: str, max_tokens: int = 8) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0}


def test_adapters_over_http():
    base = make_checkpoint("llama")
    a1, a2 = make_adapter(base, 1, r=8), make_adapter(base, 2, r=16, alpha=8, rslora=True)
    big = make_adapter(base, 4, r=32)

    async def go():
        async with app_client(dict(enable_lora=True, max_loras=2, max_lora_rank=16,
                                   lora_modules=[f"a1={a1}"])) as (client, state):
            served = state.model_name
            r = await client.get("/v1/models")
            cards = {c["id"]: c for c in r.json()["data"]}
            assert cards["a1"]["parent"] == served and cards["a1"]["root"] == a1
            assert cards[served]["parent"] is None
            assert (await client.post("/v1/completions", json=body("a2"))).status_code == 404

            r = await client.post("/v1/load_lora_adapter",
                                  json={"lora_name": "a2", "lora_path": a2})
            assert r.status_code == 200, r.text
            # the router's prefix scores salt an adapter's blocks with the replica's id
            r = await client.get("/v1/kv_summary")
            assert r.json()["lora_ids"] == {"a1": 1, "a2": 2}
            assert (await client.post("/v1/load_lora_adapter", json={
                "lora_name": "a2", "lora_path": a2})).status_code == 400  # name in use
            r = await client.post("/v1/load_lora_adapter",
                                  json={"lora_name": "big", "lora_path": big})
            assert r.status_code == 400 and "max-lora-rank" in r.json()["error"]["message"]
            r = await client.post("/v1/load_lora_adapter",
                                  json={"lora_name": "gone", "lora_path": "/nonexistent"})
            assert r.status_code == 400

            # Base and both adapters at once: each equals its reference (PEFT's, HF's).
            got = await asyncio.gather(*(client.post("/v1/completions", json=body(m))
                                         for m in (served, "a1", "a2", "a1")))
            texts = set()
            for path, r in zip((None, a1, a2, a1), got):
                texts.add(text_of(r))
                assert text_of(r) == reference_text(state, base, path, 8)
            assert len(texts) == 3  # the adapters change the continuation
            assert [r.json()["model"] for r in got] == [served, "a1", "a2", "a1"]
            r = await client.post("/v1/chat/completions", json={
                "model": "a1", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4, "stream": True})
            assert r.status_code == 200 and '"model":"a1"' in r.text

            # Unload while a long request of a2 runs: it finishes, new ones get 404.
            long = asyncio.create_task(client.post("/v1/completions", json=body("a2", 40)))
            await asyncio.sleep(0.05)
            r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
            assert r.status_code == 200
            assert text_of(await long) == reference_text(state, base, a2, 40)
            assert (await client.post("/v1/completions", json=body("a2"))).status_code == 404
            assert (await client.post("/v1/unload_lora_adapter",
                                      json={"lora_name": "a2"})).status_code == 404
            ids = {c["id"] for c in (await client.get("/v1/models")).json()["data"]}
            assert ids == {served, "a1"}

    asyncio.run(go())


def text_of(response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"].strip()


def reference_text(state, base: str, adapter: str | None, max_tokens: int) -> str:
    """PEFT's greedy tokens (transformers' without an adapter) as the server's text."""
    ids = peft_greedy(base, adapter, tuple(PROMPT), max_tokens)
    return state.engine.info.tokenizer.decode(ids, skip_special_tokens=True).strip()


def test_conveyor_serve_with_adapters_across_the_core_process():
    """The real server (engine core in its own process): the adapter crosses the typed
    messages and the config, and its answer equals PEFT's."""
    import httpx

    from server_helpers import serve

    base = make_checkpoint("llama")
    a1 = make_adapter(base, 1, r=8)
    with serve(base, "--enable-lora", "--lora-modules", f"a1={a1}", "--max-loras", "2",
               "--num-kv-blocks", "64", "--block-size", "8") as server:
        r = httpx.post(server.url + "/v1/completions", json=body("a1"), timeout=120)
        assert r.status_code == 200, r.text
        want = peft_greedy(base, a1, tuple(PROMPT), 8)
        tok = _tokenizer(base)
        assert r.json()["choices"][0]["text"].strip() == tok.decode(
            want, skip_special_tokens=True).strip()
        assert r.json()["model"] == "a1"


def _tokenizer(path: str):
    from conveyor.engine.tokenizer import load_tokenizer

    return load_tokenizer(path)


def test_an_adapter_that_fails_to_load_is_a_400(tmp_path):
    """Files that pass the load endpoint's checks (config, weights present) but hold a
    tensor that is no LoRA: the load fails on the runner's loader thread, the request
    naming it gets a 400 saying why, and the base model's requests are served."""
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    base = make_checkpoint("llama")
    bad = tmp_path / "bad"
    shutil.copytree(make_adapter(base, 1, r=8), bad)
    save_file({"base_model.model.lm_head.weight": torch.zeros(4, 4)},
              str(bad / "adapter_model.safetensors"))
    json.loads((bad / "adapter_config.json").read_text())  # (still a valid config)

    async def go():
        async with app_client(dict(enable_lora=True, max_loras=2)) as (client, state):
            r = await client.post("/v1/load_lora_adapter",
                                  json={"lora_name": "bad", "lora_path": str(bad)})
            assert r.status_code == 200, r.text
            r, ok = await asyncio.gather(client.post("/v1/completions", json=body("bad")),
                                         client.post("/v1/completions",
                                                     json=body(state.model_name)))
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "lora_load_failed" and "is not a LoRA" in err["message"]
            assert text_of(ok) == reference_text(state, base, None, 8)

    asyncio.run(go())
