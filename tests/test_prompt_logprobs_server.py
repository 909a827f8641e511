"""The server's layouts of prompt logprobs (OpenAI's echo with logprobs, streamed and not,
``max_tokens`` 0; vLLM's ``prompt_logprobs``) against transformers, and logit_bias."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from helpers import hf_model, make_checkpoint
from test_server_app import app_client

PROMPT = [5, 40, 77, 120, 9, 250, 33, 61, 18, 300, 7, 42, 99]
ATOL = 1e-5  # float32 both sides (see test_prompt_logprobs.py)


@pytest.fixture(scope="module")
def ref() -> torch.Tensor:
    """[P - 1, vocab]: transformers' log-softmax, row i scoring PROMPT[i + 1]."""
    with torch.no_grad():
        logits = hf_model(make_checkpoint("llama"))(torch.tensor([PROMPT])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)[:-1]


def body(**kw) -> dict:
    return {"prompt": PROMPT, "temperature": 0, "ignore_eos": True, **kw}


def events(text: str) -> list[dict]:
    return [json.loads(e[len("data: "):]) for e in text.split("\n\n")
            if e.startswith("data: ") and "[DONE]" not in e]


def check_echo(lps: dict, ref: torch.Tensor, k: int, generated: int) -> None:
    p = len(PROMPT)
    assert len(lps["tokens"]) == len(lps["token_logprobs"]) == p + generated
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    for i in range(1, p):
        assert abs(lps["token_logprobs"][i] - ref[i - 1, PROMPT[i]].item()) <= ATOL
        top = lps["top_logprobs"][i]
        assert len(top) in (k, k + 1) and lps["tokens"][i] in top
        assert max(top.values()) == pytest.approx(ref[i - 1].max().item(), abs=ATOL)
    offsets = lps["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], lps["tokens"]))


def test_echo_with_logprobs_streamed_and_not(ref: torch.Tensor) -> None:
    async def main() -> None:
        async with app_client() as (client, state):
            tokenizer = state.engine.info.tokenizer
            prompt_text = tokenizer.decode(PROMPT)
            # max_tokens 0: the prompt alone (what loglikelihood evaluations send).
            r = await client.post("/v1/completions",
                                  json=body(max_tokens=0, echo=True, logprobs=2))
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["text"] == prompt_text and choice["finish_reason"] == "length"
            assert r.json()["usage"]["completion_tokens"] == 0
            check_echo(choice["logprobs"], ref, 2, 0)
            # max_tokens 1 (lm-eval's local-completions): the prompt, then one token.
            r = await client.post("/v1/completions",
                                  json=body(max_tokens=3, echo=True, logprobs=1))
            whole = r.json()["choices"][0]
            check_echo(whole["logprobs"], ref, 1, 3)
            assert whole["text"].startswith(prompt_text)
            # The stream carries the same, in pieces.
            r = await client.post("/v1/completions", json=body(max_tokens=3, echo=True,
                                                               logprobs=1, stream=True))
            chunks = [e["choices"][0] for e in events(r.text) if e["choices"]]
            assert "".join(c["text"] for c in chunks) == whole["text"]
            joined = {key: [v for c in chunks for v in c["logprobs"][key]]
                      for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
            assert joined == whole["logprobs"]

    asyncio.run(main())


def test_vllm_prompt_logprobs_on_completions_and_chat(ref: torch.Tensor) -> None:
    async def main() -> None:
        async with app_client() as (client, _):
            r = await client.post("/v1/completions",
                                  json=body(max_tokens=2, prompt_logprobs=3))
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            scored = choice["prompt_logprobs"]
            assert choice["logprobs"] is None
            assert len(scored) == len(PROMPT) and scored[0] is None
            for i in range(1, len(PROMPT)):
                entry = scored[i][str(PROMPT[i])]
                assert abs(entry["logprob"] - ref[i - 1, PROMPT[i]].item()) <= ATOL
                assert entry["rank"] == int((ref[i - 1] > ref[i - 1, PROMPT[i]]).sum()) + 1
                assert {int(t) for t, e in scored[i].items() if e["rank"] <= 3} == \
                    set(torch.topk(ref[i - 1], 3).indices.tolist())
            # Not asked: absent.
            r = await client.post("/v1/completions", json=body(max_tokens=2))
            assert r.json()["choices"][0]["prompt_logprobs"] is None
            chat = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "ba be bi"}], "max_tokens": 2,
                "prompt_logprobs": 0})
            assert chat.status_code == 200, chat.text
            got = chat.json()["prompt_logprobs"]
            assert got[0] is None and all(len(e) == 1 for e in got[1:])

    asyncio.run(main())


def test_logit_bias_over_http() -> None:
    async def main() -> None:
        async with app_client() as (client, state):
            forced = state.engine.info.tokenizer.decode([17], skip_special_tokens=False)
            for temperature in (0, 1.0):
                r = await client.post("/v1/completions", json=body(
                    max_tokens=5, temperature=temperature, logprobs=0, logit_bias={"17": 100}))
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["logprobs"]["tokens"] == [forced] * 5
            chat = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "ba"}], "max_tokens": 3,
                "temperature": 0, "ignore_eos": True, "logit_bias": {"17": 100},
                "logprobs": True})
            assert chat.status_code == 200, chat.text
            content = chat.json()["choices"][0]["logprobs"]["content"]
            assert [t["token"] for t in content] == [forced] * 3

    asyncio.run(main())
