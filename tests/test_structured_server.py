"""Structured outputs over HTTP (``conveyor serve`` on a random-weight model with a byte-level
tokenizer, temperature 1): response_format json_schema / json_object on chat and
completions, vLLM's structured_outputs and guided_* fields, streamed or not, n = 2; the
openai SDK's ``chat.completions.parse`` with a pydantic model; bad constraints are a 400
naming the field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

from server_helpers import ServerProcess, serve
from structured_helpers import byte_checkpoint, strict_json

MODEL = "m"
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 8},
                         "temp": {"type": "integer", "minimum": -50, "maximum": 50}},
          "required": ["city", "temp"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "weather?"}]
SAMPLE = {"temperature": 1.0, "max_tokens": 120}


@pytest.fixture(scope="module")
def server():
    with serve(byte_checkpoint(), "--served-model-name", MODEL) as s:
        yield s


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=120)


def streamed(r: httpx.Response, n: int, key: str) -> tuple[list[str], list[str | None]]:
    """Each choice's text joined from its deltas, and its finish reason."""
    texts, reasons = [""] * n, [None] * n
    for e in r.text.split("\n\n"):
        if e.startswith("data: ") and "[DONE]" not in e:
            for c in json.loads(e[6:])["choices"]:
                piece = c["delta"].get("content") if key == "delta" else c.get("text")
                texts[c["index"]] += piece or ""
                reasons[c["index"]] = c.get("finish_reason") or reasons[c["index"]]
    return texts, reasons


JSON_SCHEMA_FORMAT = {"type": "json_schema",
                      "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schema_outputs_validate(server: ServerProcess, stream: bool) -> None:
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "n": 2, "stream": stream,
                                              "response_format": JSON_SCHEMA_FORMAT, **SAMPLE})
    assert r.status_code == 200, r.text
    if stream:
        texts, reasons = streamed(r, 2, "delta")
    else:
        texts = [c["message"]["content"] for c in r.json()["choices"]]
        reasons = [c["finish_reason"] for c in r.json()["choices"]]
    assert reasons == ["stop", "stop"]
    for text in texts:
        jsonschema.validate(strict_json(text), SCHEMA)


@pytest.mark.parametrize("body, valid", [
    ({"response_format": {"type": "json_object"}},
     lambda t: isinstance(strict_json(t), dict)),
    ({"structured_outputs": {"regex": "[A-Z][a-z]{1,6}"}},
     lambda t: re.fullmatch("[A-Z][a-z]{1,6}", t)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(strict_json(t), SCHEMA) is None),
    ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] [0-9]?'}},
     lambda t: re.fullmatch("x[0-9]{1,2}", t)),
])
@pytest.mark.parametrize("stream", [False, True])
def test_completions_take_every_kind(server: ServerProcess, body: dict, valid,
                                     stream: bool) -> None:
    r = post(server, "/v1/completions", {"prompt": ["one", "two"], "stream": stream,
                                         **body, **SAMPLE, "max_tokens": 200})
    assert r.status_code == 200, r.text
    if stream:
        texts, reasons = streamed(r, 2, "text")
    else:
        texts = [c["text"] for c in r.json()["choices"]]
        reasons = [c["finish_reason"] for c in r.json()["choices"]]
    for text, reason in zip(texts, reasons):
        if "json_object" in str(body) and reason == "length":
            assert text.startswith("{")  # any JSON may nest past max_tokens
            continue
        assert reason == "stop", text
        assert valid(text), text


def test_response_format_structural_tag(server: ServerProcess) -> None:
    # Every quote the model writes opens a structure (free text between them).
    r = post(server, "/v1/chat/completions", {"messages": CHAT, **SAMPLE, "max_tokens": 60,
                                              "n": 4, "response_format": {
        "type": "structural_tag", "triggers": ['"'],
        "structures": [{"begin": '"x=', "schema": {"enum": [1, 2]}, "end": '"'}]}})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        text = c["message"]["content"]
        if c["finish_reason"] == "length":
            text = re.sub(r'"(x(=([12]"?)?)?)?$', "", text)
        assert re.fullmatch(r'[^"]*("x=[12]"[^"]*)*', text), text


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=8)
    temp: int = pydantic.Field(ge=-50, le=50)
    sunny: bool


def test_the_openai_sdk_parse_with_a_pydantic_model(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.parse(model=MODEL, messages=CHAT, response_format=Weather,
                                        temperature=1.0, max_tokens=120, n=2)
    for choice in out.choices:
        assert isinstance(choice.message.parsed, Weather), choice.message.content


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "if": {"required": ["a"]}}}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/completions", {"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
    ("/v1/completions", {"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ("/v1/chat/completions", {"response_format": {"type": "structural_tag", "triggers": ["<a"],
                                                  "structures": [{"begin": "<b>", "end": "",
                                                                  "schema": {}}]}},
     "response_format"),
    ("/v1/completions", {"structured_outputs": {"regex": "a"}, "guided_choice": ["b"]},
     "guided_choice"),
    ("/v1/completions", {"guided_json": {"type": "string", "format": "nope"}}, "guided_json"),
    ("/v1/completions", {"structured_outputs": {"regex": "a"}, "ignore_eos": True},
     "ignore_eos"),
])
def test_bad_constraints_are_a_400_naming_the_field(server: ServerProcess, path: str,
                                                    body: dict, param: str) -> None:
    prompt = {"messages": CHAT} if "chat" in path else {"prompt": "x"}
    r = post(server, path, {**prompt, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
