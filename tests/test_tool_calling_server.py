"""Tool calling over HTTP on a random-weight model at temperature 1 (no structure from the
model): every required or named call parses and matches its function's parameters,
streamed or not, n = 2, parallel_tool_calls honoured; finish_reason "tool_calls"; the
chat template renders tools; the openai SDK's tool-calling round trip; bad tool requests
are a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from server_helpers import ServerProcess, serve
from structured_helpers import byte_checkpoint

MODEL = "m"
WEATHER = {"type": "object",
           "properties": {"city": {"enum": ["Paris", "Lyon", "Nice"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 6}},
        "required": ["tz"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER,
                                           "strict": True}},
         {"type": "function", "function": {"name": "time", "parameters": TIME}}]
SCHEMAS = {"weather": WEATHER, "time": TIME}
CHAT = [{"role": "user", "content": "weather in Paris?"}]
SAMPLE = {"temperature": 1.0, "max_tokens": 200}
# ChatML plus the tools, Hermes-style, in a system turn: what a tool-calling checkpoint's
# template does (the byte-level test tokenizer's own template ignores tools).
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def server():
    with serve(byte_checkpoint(), "--served-model-name", MODEL, "--chat-template", TEMPLATE,
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as s:
        yield s


def post(server: ServerProcess, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions",
                      json={"model": MODEL, "messages": CHAT, **body}, timeout=120)


def check_calls(calls: list[dict], only: str | None = None, at_most: int | None = None) -> None:
    assert calls, "no tool call"
    if at_most is not None:
        assert len(calls) <= at_most
    for call in calls:
        name = call["function"]["name"]
        assert only is None or name == only
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
        assert call["id"] and call["type"] == "function"


def streamed_calls(r: httpx.Response, n: int) -> tuple[list[list[dict]], list[str]]:
    """Each choice's calls joined from the stream's deltas, and its finish reason."""
    calls: list[dict[int, dict]] = [{} for _ in range(n)]
    reasons = [""] * n
    for e in r.text.split("\n\n"):
        if not e.startswith("data: ") or "[DONE]" in e:
            continue
        for c in json.loads(e[6:])["choices"]:
            for d in c["delta"].get("tool_calls") or []:
                if d["index"] not in calls[c["index"]]:
                    assert d["function"]["name"], "the first delta names the function"
                    calls[c["index"]][d["index"]] = {"id": d["id"], "type": d["type"],
                                                     "function": dict(d["function"])}
                else:
                    assert "name" not in d["function"]
                    calls[c["index"]][d["index"]]["function"]["arguments"] += \
                        d["function"]["arguments"]
            reasons[c["index"]] = c.get("finish_reason") or reasons[c["index"]]
    return [[cs[i] for i in sorted(cs)] for cs in calls], reasons


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice, only", [
    ("required", None),
    ({"type": "function", "function": {"name": "time"}}, "time"),
])
@pytest.mark.parametrize("parallel", [None, False])
def test_required_and_named_calls_always_parse(server: ServerProcess, stream: bool,
                                               choice, only, parallel) -> None:
    body = {"tools": TOOLS, "tool_choice": choice, "n": 2, "stream": stream, **SAMPLE}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    r = post(server, body)
    assert r.status_code == 200, r.text
    if stream:
        calls, reasons = streamed_calls(r, 2)
    else:
        choices = r.json()["choices"]
        calls = [c["message"]["tool_calls"] for c in choices]
        reasons = [c["finish_reason"] for c in choices]
        assert all(c["message"]["content"] is None for c in choices)
    assert reasons == ["tool_calls", "tool_calls"]
    for cs in calls:
        check_calls(cs, only, at_most=1 if parallel is False or only else None)


def test_the_template_renders_tools_unless_choice_is_none(server: ServerProcess) -> None:
    def prompt_tokens(body: dict) -> int:
        r = post(server, {"max_tokens": 1, **body})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    plain = prompt_tokens({})
    assert prompt_tokens({"tools": TOOLS, "tool_choice": "none"}) == plain
    assert prompt_tokens({"tools": TOOLS, "tool_choice": "auto"}) > plain + 50


def test_auto_returns_text_when_the_model_calls_nothing(server: ServerProcess) -> None:
    r = post(server, {"tools": TOOLS, "temperature": 0, "max_tokens": 8})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["tool_calls"] == [] and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")


def test_the_openai_sdk_tool_round_trip(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    first = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS,
                                           tool_choice="required", temperature=1.0,
                                           max_tokens=200, parallel_tool_calls=False)
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    (call,) = msg.tool_calls
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    messages = [*CHAT, msg.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"ok": 1})}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                            tool_choice="none", max_tokens=5, temperature=0)
    assert second.choices[0].message.content is not None


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "if": {}}}}], "tool_choice": "required"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tool_requests_are_a_400_naming_the_field(server: ServerProcess, body: dict,
                                                      param: str) -> None:
    r = post(server, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
