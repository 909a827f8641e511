"""Real clients, unmodified: fields conveyor does not know are ignored (one warning per name),
nulls mean the default, vLLM's continuous_usage_stats and /tokenize, /detokenize, /version,
a body size limit answered before parsing, and chat messages without content refused."""

from __future__ import annotations

import asyncio
import json
import logging
import socket

import httpx
import openai
import pytest

from conveyor.entrypoints.openai import serving_common
from conveyor.entrypoints.openai.errors import warn_ignored

from helpers import make_checkpoint
from server_helpers import ServerProcess, serve
from test_server_app import app_client

MODEL = "m"
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server():
    with serve(make_checkpoint("llama"), "--served-model-name", MODEL,
               "--max-request-body-bytes", str(BODY_LIMIT)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def post(server: ServerProcess, path: str, body: dict | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"Content-Type": "application/json"})


def events(r: httpx.Response) -> list[dict]:
    return [json.loads(e[len("data: "):]) for e in r.text.split("\n\n")
            if e.startswith("data: ") and "[DONE]" not in e]


GREEDY = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
CHAT = [{"role": "user", "content": "ba be bi"}]


# ---- fields real clients send ----------------------------------------------------------
ACCEPTED_COMPLETION_EXTRAS = [
    {"stop": None},
    {"stream_options": None, "logprobs": None, "suffix": None, "seed": None},
    {"user": "u1", "metadata": {"run": "a"}, "store": False, "service_tier": "auto"},
    {"seed": 7, "n": 2},
    {"some_future_field": {"nested": 1}},
    {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True,
                                        "unknown_option": 1}},
]


@pytest.mark.parametrize("extra", ACCEPTED_COMPLETION_EXTRAS)
def test_completion_bodies_real_clients_send(server: ServerProcess, extra: dict) -> None:
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "ba be", **GREEDY, **extra})
    assert r.status_code == 200, r.text
    if extra.get("stream"):
        assert events(r)[-1]["usage"]["completion_tokens"] == 5
    else:
        assert all(c["text"] for c in r.json()["choices"])
        assert len(r.json()["choices"]) == extra.get("n", 1)


ACCEPTED_CHAT_EXTRAS = [
    {"max_completion_tokens": 5, "max_tokens": None},
    {"logprobs": True, "top_logprobs": 2},
    {"n": 2, "seed": 3, "user": "u", "metadata": {}, "store": False, "service_tier": None},
    {"parallel_tool_calls": False, "tool_choice": None, "tools": None},
    {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"},
    {"response_format": {"type": "text"}, "reasoning_effort": "low"},
]


@pytest.mark.parametrize("extra", ACCEPTED_CHAT_EXTRAS)
def test_chat_bodies_real_clients_send(server: ServerProcess, extra: dict) -> None:
    body = {"model": MODEL, "messages": CHAT, **GREEDY, **extra}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == extra.get("n", 1)
    assert r.json()["usage"]["completion_tokens"] == 5 * len(choices)
    if extra.get("logprobs"):
        assert len(choices[0]["logprobs"]["content"]) == 5


def test_the_seed_is_honoured(server: ServerProcess) -> None:
    def sample(seed: int) -> str:
        body = {"model": MODEL, "prompt": "ba be", "max_tokens": 12, "temperature": 1.5,
                "ignore_eos": True, "seed": seed}
        return post(server, "/v1/completions", body).json()["choices"][0]["text"]

    assert sample(11) == sample(11)
    assert len({sample(s) for s in range(4)}) > 1


REFUSED = [
    ("/v1/completions", {"prompt": "ba", "logit_bias": {"5": -101}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema",
     "json_schema": {"name": "x", "schema": {"type": "object", "if": {}}}}}, "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": "sometimes"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": "f"}}]}, "tool_choice"),  # auto needs --enable-auto-tool-choice
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [CHAT[0], {"role": "assistant", "content": None}]},
     "messages[1].content"),
    ("/v1/completions", {"prompt": "ba", "max_tokens": "5"}, "max_tokens"),
]


@pytest.mark.parametrize("path, body, param", REFUSED)
def test_values_conveyor_cannot_honour_are_a_400_naming_the_field(
        server: ServerProcess, path: str, body: dict, param: str) -> None:
    r = post(server, path, {"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_an_assistant_message_with_tool_calls_may_omit_content(server: ServerProcess) -> None:
    messages = [CHAT[0],
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                      "function": {"name": "f",
                                                                   "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, **GREEDY})
    assert r.status_code == 200, r.text


def test_the_openai_sdk_with_extra_body(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt="ba be", max_tokens=4, temperature=0, user="x", seed=1,
        extra_body={"ignore_eos": True, "top_k": 5, "stop": None, "not_a_field": 1})
    assert out.usage.completion_tokens == 4
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_completion_tokens=4, temperature=0, n=1,
        metadata={"k": "v"}, store=False, logprobs=True, top_logprobs=1,
        extra_body={"ignore_eos": True, "chat_template_kwargs": None, "whatever": [1]})
    assert chat.usage.completion_tokens == 4
    assert len(chat.choices[0].logprobs.content) == 4


# ---- continuous_usage_stats ----------------------------------------------------------------
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": ["ba be", "di do du"], "n": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "n": 2}),
])
def test_continuous_usage_adds_up_chunk_by_chunk(server: ServerProcess, path: str,
                                                 body: dict) -> None:
    opts = {"include_usage": True, "continuous_usage_stats": True}
    r = post(server, path, {"model": MODEL, **body, "max_tokens": 7, "temperature": 0,
                            "ignore_eos": True, "stream": True, "stream_options": opts})
    assert r.status_code == 200
    chunks = events(r)
    assert all(c.get("usage") for c in chunks), "usage in every chunk"
    final = chunks[-1]
    assert final["choices"] == []
    counted = 0
    for c in chunks[:-1]:
        for choice in c["choices"]:
            if path == "/v1/completions":
                # a token's text may be empty; the tokens of a choice add up to 7
                counted = c["usage"]["completion_tokens"]
            elif choice["delta"].get("content") is not None and "role" not in choice["delta"]:
                counted = c["usage"]["completion_tokens"]
        usage = c["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    so_far = [c["usage"]["completion_tokens"] for c in chunks]
    assert so_far == sorted(so_far), "completion tokens so far never go back"
    num_choices = 4 if path == "/v1/completions" else 2
    assert counted == final["usage"]["completion_tokens"] == 7 * num_choices
    if path == "/v1/chat/completions":  # one prompt: its length is known in every chunk
        assert {c["usage"]["prompt_tokens"] for c in chunks} == \
            {final["usage"]["prompt_tokens"]}


def test_without_continuous_usage_only_the_last_chunk_has_usage(server: ServerProcess) -> None:
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "ba", **GREEDY,
                                         "stream": True,
                                         "stream_options": {"include_usage": True}})
    chunks = events(r)
    assert [bool(c.get("usage")) for c in chunks] == [False] * (len(chunks) - 1) + [True]


# ---- vLLM's routes -----------------------------------------------------------------------
def test_tokenize_counts_what_the_completion_uses(server: ServerProcess) -> None:
    prompt = "ba be bi bo bu"
    tok = post(server, "/tokenize", {"model": MODEL, "prompt": prompt,
                                     "return_token_strs": True}).json()
    done = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, **GREEDY}).json()
    assert tok["count"] == len(tok["tokens"]) == done["usage"]["prompt_tokens"]
    assert len(tok["token_strs"]) == tok["count"] and tok["max_model_len"] > 0
    chat_tok = post(server, "/tokenize", {"model": MODEL, "messages": CHAT}).json()
    chat = post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT,
                                                 **GREEDY}).json()
    assert chat_tok["count"] == chat["usage"]["prompt_tokens"]
    back = post(server, "/detokenize", {"model": MODEL, "tokens": tok["tokens"]}).json()
    assert back["prompt"].strip() == prompt
    assert post(server, "/tokenize", {"model": MODEL}).status_code == 400
    assert post(server, "/detokenize", {"tokens": [10 ** 9]}).json()["error"]["param"] == \
        "tokens"
    assert post(server, "/tokenize", {"model": "other", "prompt": "x"}).status_code == 404


def test_version(server: ServerProcess) -> None:
    import conveyor

    r = httpx.get(server.url + "/version")
    assert r.status_code == 200 and r.json() == {"version": conveyor.__version__}


# ---- bodies too large, prompts too long -----------------------------------------------------
def test_a_body_over_the_limit_is_a_413_before_it_is_read(server: ServerProcess) -> None:
    big = json.dumps({"model": MODEL, "prompt": "ba " * BODY_LIMIT, "max_tokens": 1})
    r = post(server, "/v1/completions", big)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    # A declared length over the limit is refused with no body sent at all.
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: " + str(10 * BODY_LIMIT).encode() + b"\r\n\r\n")
        head = s.recv(4096).decode(errors="replace")
    assert head.startswith("HTTP/1.1 413"), head
    # Chunked (no Content-Length): refused once the chunks pass the limit.
    chunks = (b'{"prompt": "' + b"ba " * 1000 for _ in range(BODY_LIMIT // 1000 + 2))
    r = httpx.post(server.url + "/v1/completions", content=chunks, timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    ok = post(server, "/v1/completions", {"model": MODEL, "prompt": "ba", **GREEDY})
    assert ok.status_code == 200  # and the server goes on


def test_a_prompt_too_long_for_any_tokenization_is_refused_untokenized(monkeypatch) -> None:
    calls = []

    async def main() -> None:
        async with app_client() as (client, state):
            assert state.max_prompt_bytes is not None
            tokenizer = state.engine.info.tokenizer
            real_encode = tokenizer.encode

            def counting_encode(*a, **kw):
                calls.append(1)
                return real_encode(*a, **kw)

            monkeypatch.setattr(tokenizer, "encode", counting_encode)
            huge = "b" * (state.max_prompt_bytes + 1)
            for path, body, param in [
                    ("/v1/completions", {"prompt": huge, "max_tokens": 1}, "prompt"),
                    ("/v1/chat/completions",
                     {"messages": [{"role": "user", "content": huge}]}, "messages"),
                    ("/tokenize", {"prompt": huge}, "prompt")]:
                r = await client.post(path, json=body)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
                assert "max_model_len" in r.json()["error"]["message"]
            assert calls == []
            # The cap is a true bound: the longest token repeated max_model_len times fits
            # under it, so no prompt that could fit is refused by it.
            per_token = serving_common.max_token_bytes(tokenizer)
            assert per_token * state.max_model_len <= state.max_prompt_bytes

    asyncio.run(main())


def test_an_unknown_field_is_logged_once_per_name(caplog) -> None:
    warn_ignored._seen.clear()

    async def main() -> None:
        async with app_client() as (client, _state):
            for _ in range(3):
                r = await client.post("/v1/completions", json={
                    "prompt": "ba", "max_tokens": 1, "frobnicate": 1,
                    "stream": True, "stream_options": {"include_usage": True, "shiny": 2}})
                assert r.status_code == 200

    with caplog.at_level(logging.WARNING, logger="conveyor.server"):
        asyncio.run(main())
    warned = [rec.getMessage() for rec in caplog.records if "unrecognized" in rec.getMessage()]
    assert len(warned) == 2, warned
    assert any("'frobnicate'" in w for w in warned)
    assert any("'stream_options.shiny'" in w for w in warned)
