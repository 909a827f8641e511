"""The OpenAI-compatible server, end to end: a real server process on a loopback port, driven
with the official ``openai`` SDK (and raw HTTP for the error cases), checked against the
offline ``LLM`` on the same checkpoint."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import openai
import pytest

from conveyor import LLM, SamplingParams

from helpers import cpu_threads, make_checkpoint
from server_helpers import ATTENTION_BACKEND, ServerProcess, serve

MODEL = "tiny-llama"
PROMPTS = ["ba be bi bo", "da de di do du fa", "ka ke", "la le li lo lu ma me mi mo"]


@pytest.fixture(scope="module")
def checkpoint() -> str:
    return make_checkpoint("llama")


@pytest.fixture(scope="module")
def server(checkpoint: str, request: pytest.FixtureRequest):
    with serve(checkpoint, "--served-model-name", MODEL, "--block-size", "8",
               "--num-kv-blocks", "256", wait=False) as s:
        request.getfixturevalue("offline")  # built while the server boots
        s.wait_ready(180.0)
        yield s


@pytest.fixture(scope="module")
def offline(checkpoint: str) -> LLM:
    return LLM(checkpoint, dtype="float32", num_threads=cpu_threads(), block_size=8,
               num_kv_blocks=256, attention_backend=ATTENTION_BACKEND)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def offline_text(llm: LLM, prompt: str, **params) -> tuple[str, list[int]]:
    out = llm.generate([prompt], SamplingParams(**params))[0].outputs[0]
    return out.text, out.token_ids


def chat_prompt(llm: LLM, messages: list[dict]) -> str:
    """The reference rendering: transformers' own apply_chat_template."""
    return llm.get_tokenizer().apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=True)


# ---- happy paths with the SDK --------------------------------------------------------------
def test_health_and_models(server: ServerProcess, client: openai.OpenAI) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_equals_offline(client: openai.OpenAI, offline: LLM,
                                          prompt: str) -> None:
    want, tokens = offline_text(offline, prompt, max_tokens=12, temperature=0.0)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert got.choices[0].text == want
    assert got.usage.completion_tokens == len(tokens)
    prompt_len = len(offline.get_tokenizer().encode(prompt, add_special_tokens=False))
    assert got.usage.prompt_tokens == prompt_len
    assert got.usage.total_tokens == prompt_len + len(tokens)
    assert got.choices[0].finish_reason == ("length" if len(tokens) == 12 else "stop")


def test_prompt_list_and_token_ids(client: openai.OpenAI, offline: LLM) -> None:
    ids = offline.get_tokenizer().encode(PROMPTS[1], add_special_tokens=False)
    got = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=6,
                                    temperature=0)
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [
        offline_text(offline, p, max_tokens=6, temperature=0.0)[0] for p in PROMPTS[:2]]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == got.choices[1].text


def test_streaming_completion(client: openai.OpenAI, offline: LLM) -> None:
    want, tokens = offline_text(offline, PROMPTS[0], max_tokens=48, temperature=0.0,
                                ignore_eos=True)
    chunks = list(client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=48, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text_chunks = [c for c in chunks if c.choices]
    # How many chunks the text comes in is the race between this client and a tiny
    # model (a consumer that falls behind gets the waiting deltas merged, by design; a
    # loaded CI machine once got all 48 tokens in one chunk), so it is not asserted
    # here: test_async_engine.py's gated engine checks one delta a step and the merge.
    assert "".join(c.choices[0].text for c in text_chunks) == want
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == len(tokens) == 48


def test_sse_wire_format(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 3, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunk = json.loads(lines[0][len("data: "):])
    assert chunk["object"] == "text_completion" and chunk["model"] == MODEL


def test_chat_completion_uses_the_checkpoint_template(client: openai.OpenAI,
                                                      offline: LLM) -> None:
    messages = [{"role": "system", "content": "ba be"},
                {"role": "user", "content": "di do du"}]
    want, tokens = offline_text(offline, chat_prompt(offline, messages), max_tokens=8,
                                temperature=0.0)
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                         temperature=0)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want
    assert got.usage.completion_tokens == len(tokens)

    stream = client.chat.completions.create(model=MODEL, messages=messages,
                                            max_completion_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == len(tokens)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_n_greater_than_one(client: openai.OpenAI) -> None:
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=7, n=3,
                                    temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in got.choices) == [0, 1, 2]
    assert got.usage.completion_tokens == 21
    assert len({c.text for c in got.choices}) > 1, "seeded samples should differ"
    again = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=7, n=3,
                                      temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in got.choices]

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "ba"}], max_tokens=5, n=2,
        temperature=1.0, seed=3, stream=True, extra_body={"ignore_eos": True}))
    texts = {0: "", 1: ""}
    finishes = {0: [], 1: []}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert finishes == {0: ["length"], 1: ["length"]}
    assert texts[0] and texts[1]


def test_completion_logprobs_match_offline(client: openai.OpenAI, offline: LLM) -> None:
    ref = offline.generate([PROMPTS[3]], SamplingParams(max_tokens=5, temperature=0.0,
                                                        logprobs=2, ignore_eos=True))
    ref_out = ref[0].outputs[0]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=5,
                                    temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for token_id, entry, value, top in zip(ref_out.token_ids, ref_out.logprobs,
                                           lp.token_logprobs, lp.top_logprobs):
        assert math.isclose(value, entry[token_id].logprob, abs_tol=1e-4)
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(value, abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(client: openai.OpenAI) -> None:
    got = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "ba be"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens == 4
    assert all(t.token for t in content)
    for t in content:
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert t.logprob == pytest.approx(tops[0], abs=1e-5)  # greedy takes the top token
        assert t.bytes == list(t.token.encode())


def test_echo_stop_and_cached_tokens(client: openai.OpenAI, offline: LLM) -> None:
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4,
                                       temperature=0, echo=True)
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4,
                                      temperature=0)
    assert echoed.choices[0].text == PROMPTS[1] + plain.choices[0].text

    full, _ = offline_text(offline, PROMPTS[3], max_tokens=12, temperature=0.0,
                           ignore_eos=True)
    stop = full.split()[3]
    want, _ = offline_text(offline, PROMPTS[3], max_tokens=12, temperature=0.0,
                           ignore_eos=True, stop=[stop])
    got = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=12,
                                    temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == want and stop not in want
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].stop_reason == stop  # vLLM's extra field, kept by the SDK

    # The same long prompt twice: the second finds its full blocks in the prefix cache.
    long_prompt = " ".join(["ba be bi bo bu"] * 6)
    first = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 8 == 0 and cached < second.usage.prompt_tokens


# ---- bad input: raw HTTP -------------------------------------------------------------------
BAD_COMPLETIONS = [
    ('{"prompt": "ba", "max_tokens": 4', 400, None, "JSON"),
    ('[1, 2]', 400, None, "object"),
    ('{"model": "gpt-4", "prompt": "ba"}', 404, "model", "gpt-4"),
    ('{"prompt": "ba", "max_tokens": "4"}', 400, "max_tokens", "integer"),
    ('{"prompt": "ba", "temperature": "hot"}', 400, "temperature", "number"),
    ('{"prompt": 7}', 400, "prompt", "str"),
    ('{"prompt": "ba", "stream": "yes"}', 400, "stream", "boolean"),
    ('{"prompt": "ba", "n": 1.5}', 400, "n", "integer"),
    ('{"max_tokens": 3}', 400, "prompt", "required"),
    ('{"prompt": "ba", "max_tokens": 0}', 400, "max_tokens", ">= 1"),
    ('{"prompt": "ba", "temperature": -1}', 400, "temperature", ">= 0"),
    ('{"prompt": "ba", "top_p": 1.5}', 400, "top_p", "(0, 1]"),
    ('{"prompt": "ba", "n": 0}', 400, "n", "greater than or equal to 1"),
    ('{"prompt": "ba", "logprobs": 30}', 400, "logprobs", "[0, 20]"),
    ('{"prompt": "ba", "presence_penalty": 3}', 400, "presence_penalty", "[-2, 2]"),
    ('{"prompt": "ba", "min_tokens": 9, "max_tokens": 2}', 400, "min_tokens", "max_tokens"),
    ('{"prompt": "ba", "stop": ""}', 400, "stop", "non-empty"),
    ('{"prompt": "ba", "stop_token_ids": [99999]}', 400, "stop_token_ids", "outside"),
    ('{"prompt": [5, 99999]}', 400, "prompt", "outside"),
    ('{"prompt": []}', 400, "prompt", "empty"),
    ('{"prompt": ""}', 400, "prompt", "empty"),
    ('{"prompt": "ba", "echo": true, "logprobs": 30}', 400, "logprobs", "[0, 20]"),
    ('{"prompt": "ba", "prompt_logprobs": 21}', 400, "prompt_logprobs", "[0, 20]"),
    ('{"prompt": "ba", "prompt_logprobs": 1, "stream": true}', 400, "prompt_logprobs",
     "stream"),
    ('{"prompt": "ba", "stream_options": {"include_usage": true}}', 400, "stream_options",
     "stream"),
    ('{"prompt": "ba", "slo_ttft_ms": -5}', 400, "slo_ttft_ms", "> 0"),
    ('{"prompt": "ba", "temperature": NaN}', 400, "temperature", "finite"),
    ('{"prompt": "ba", "logit_bias": {"5": 300}}', 400, "logit_bias", "[-100, 100]"),
    ('{"prompt": "ba", "logit_bias": {"five": 3}}', 400, "logit_bias", "token ids"),
    ('{"prompt": "ba", "logit_bias": {"99999": 3}}', 400, "logit_bias", "outside"),
    ('{"prompt": ["ba", [1, 2]]}', 400, "prompt", "list[str]"),
]


@pytest.mark.parametrize("body, status, param, needle", BAD_COMPLETIONS)
def test_bad_completion_requests(server: ServerProcess, body: str, status: int,
                                 param: str | None, needle: str) -> None:
    r = httpx.post(server.url + "/v1/completions", content=body,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert needle.lower() in error["message"].lower(), error
    assert error["type"] and isinstance(error["message"], str)


BAD_CHATS = [
    ({"messages": "hi"}, "messages", "array"),
    ({"messages": []}, "messages", "at least 1"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages",
     "text only"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50},
     "top_logprobs", "[0, 20]"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools", "must be"),
    ({"messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"schema": {"if": {}}}}},
     "response_format", "Unimplemented"),
    ({"messages": [{"role": "user", "content": "ba " * 600}]}, "messages", "max_model_len"),
]


@pytest.mark.parametrize("body, param, needle", BAD_CHATS)
def test_bad_chat_requests(server: ServerProcess, body: dict, param: str,
                           needle: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error


def test_too_long_prompt_is_a_400_and_the_server_keeps_serving(
        server: ServerProcess, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="ba " * 700, max_tokens=4)
    assert info.value.body["param"] == "prompt"
    assert "max_model_len" in info.value.body["message"]
    ok = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3)
    assert ok.usage.completion_tokens >= 1
    assert httpx.post(server.url + "/v1/nothing", json={}).status_code == 404


# ---- load, disconnects and metrics ---------------------------------------------------------
def test_32_concurrent_streaming_clients(server: ServerProcess, offline: LLM) -> None:
    words = [c + v for c in "bdfg" for v in "aeiou"]  # ba be bi bo bu da ... gu
    prompts = [" ".join(words[i % 7:i % 7 + 2 + i % 5]) for i in range(32)]
    lengths = [4 + (i * 7) % 13 for i in range(32)]
    want = [o.outputs[0].text for o in offline.generate(
        prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                  for n in lengths])]

    async def one(client: openai.AsyncOpenAI, prompt: str, n: int) -> tuple[str, int, str]:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return text, usage, finish

    async def main() -> list[tuple[str, int, str]]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                      max_retries=0) as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

    results = asyncio.run(main())
    assert [r[1] for r in results] == lengths
    assert all(r[2] == "length" for r in results)
    assert [r[0] for r in results] == want
    assert server.metrics()["conveyor:num_requests_running"] == 0


# Client disconnects (streaming and not) are tested in-process, deterministically:
# test_server_app.py::test_a_client_that_disconnects_aborts_its_request.


def test_metrics_after_a_burst(server: ServerProcess, client: openai.OpenAI) -> None:
    before = server.metrics()
    prompt = "ga ge gi go gu " * 4  # 20 tokens: the later requests hit 2 cached blocks
    lengths = [3, 5, 8, 2, 6]
    for n in lengths:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=n,
                                  extra_body={"ignore_eos": True})
    after = server.metrics()

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    prompt_len = client.completions.create(model=MODEL, prompt=prompt,
                                           max_tokens=1).usage.prompt_tokens
    assert delta('conveyor:request_success_total{finished_reason="length"}') == 5
    assert delta("conveyor:generation_tokens_total") == sum(lengths)
    assert delta("conveyor:request_generation_tokens_sum") == sum(lengths)
    assert delta("conveyor:request_prompt_tokens_sum") == 5 * prompt_len
    assert delta("conveyor:prompt_tokens_total") == 5 * prompt_len  # cache hits included
    assert delta("conveyor:prefix_cache_queries_total") == 5 * prompt_len
    assert delta("conveyor:prefix_cache_hits_total") == 4 * 16
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "time_per_output_token_seconds"):
        assert delta(f"conveyor:{hist}_count") == 5, hist
    assert delta("conveyor:inter_token_latency_seconds_count") == sum(lengths) - 5
    for name in ("kv_cache_usage_perc", "num_requests_waiting", "kv_cache_cached_blocks",
                 "kv_cache_evictable_blocks", "prefix_cache_hit_rate",
                 "num_requests_rejected_total", "num_preemptions_total"):
        assert f"conveyor:{name}" in after, name
    assert after["conveyor:kv_cache_total_blocks"] == 256
    assert after["conveyor:kv_cache_evictable_blocks"] >= 2
