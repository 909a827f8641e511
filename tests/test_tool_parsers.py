"""Tool-call parsers on golden texts of each format, whole and split into stream deltas
(every split point): the streamed content and calls add up to the whole parse, a call's
name comes before its arguments, and content never leaks the start of a call marker."""

from __future__ import annotations

import json

import pytest

from conveyor.entrypoints.openai.tool_calls import ToolCallStream, ToolPlan, finish_reason
from conveyor.entrypoints.openai.tool_parsers import get_tool_parser

WEATHER = {"city": "Paris", "unit": "c"}
TIME = {"tz": "UTC+1"}

GOLDEN = {
    "hermes": [
        ('<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
         '</tool_call>', "", [("weather", WEATHER)]),
        ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", '
         '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "time", "arguments": '
         '{"tz": "UTC+1"}}\n</tool_call>', "Let me check.\n",
         [("weather", WEATHER), ("time", TIME)]),
        ("No tools needed: 1 < 2 and <tool is a word.", "No tools needed: 1 < 2 and <tool "
         "is a word.", []),
    ],
    "llama3_json": [
        ('{"name": "weather", "parameters": {"city": "Paris", "unit": "c"}}', "",
         [("weather", WEATHER)]),
        ('<|python_tag|>{"name": "weather", "parameters": {"city": "Paris", "unit": "c"}}; '
         '{"name": "time", "parameters": {"tz": "UTC+1"}}', "",
         [("weather", WEATHER), ("time", TIME)]),
        ("The weather is {fine}.", "The weather is {fine}.", []),
        ("{not a call}", "{not a call}", []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Paris", "unit": "c"}}]', "",
         [("weather", WEATHER)]),
        ('Sure. [TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Paris", "unit": '
         '"c"}}, {"name": "time", "arguments": {"tz": "UTC+1"}}]', "Sure. ",
         [("weather", WEATHER), ("time", TIME)]),
        ("A [TOOL] tag [TOOLS] is not [TOOL_CALL] one.", "A [TOOL] tag [TOOLS] is not "
         "[TOOL_CALL] one.", []),
    ],
}
CASES = [(name, *case) for name, cases in GOLDEN.items() for case in cases]


def plan(parser: str) -> ToolPlan:
    return ToolPlan("auto", [], parser=get_tool_parser(parser))


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_whole(parser: str, text: str, content: str, calls: list) -> None:
    got_content, got_calls = ToolCallStream(plan(parser)).message(text)
    assert (got_content or "") == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in got_calls] == calls
    assert len({c["id"] for c in got_calls}) == len(got_calls)


def stream(parser_plan: ToolPlan, pieces: list[str]) -> tuple[str, dict[int, list]]:
    s = ToolCallStream(parser_plan)
    content, calls, text = "", {}, ""
    for i, piece in enumerate(pieces):
        text += piece
        c, deltas = s.update(text, final=i == len(pieces) - 1)
        content += c
        for d in deltas:
            calls.setdefault(d["index"], []).append(d)
    return content, calls


def check_stream(content: str, calls: dict[int, list], want_content: str, want: list) -> None:
    assert content == want_content
    assert len(calls) == len(want)
    for i, (name, args) in enumerate(want):
        first, *rest = calls[i]
        assert first["function"]["name"] == name and first["id"] and first["type"] == "function"
        assert all("name" not in d["function"] for d in rest)
        assert json.loads("".join(d["function"]["arguments"] for d in calls[i])) == args


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_streamed_in_two_at_every_split(parser: str, text: str, content: str,
                                        calls: list) -> None:
    for cut in range(1, len(text)):
        got_content, got_calls = stream(plan(parser), [text[:cut], text[cut:]])
        check_stream(got_content, got_calls, content, calls)


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_streamed_character_by_character(parser: str, text: str, content: str,
                                         calls: list) -> None:
    got_content, got_calls = stream(plan(parser), list(text))
    check_stream(got_content, got_calls, content, calls)


def test_required_and_named_outputs_stream_the_same_way() -> None:
    required = '[{"name":"weather","parameters":{"city":"Paris","unit":"c"}},' \
               '{"name":"time","parameters":{"tz":"UTC+1"}}]'
    content, calls = stream(ToolPlan("required", []), list(required))
    check_stream(content, calls, "", [("weather", WEATHER), ("time", TIME)])
    named = '{"city":"Paris","unit":"c"}'
    content, calls = stream(ToolPlan("named", [], function="weather"), list(named))
    check_stream(content, calls, "", [("weather", WEATHER)])


def test_finish_reason_is_tool_calls_only_after_a_stop() -> None:
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("length", True) == "length"
    assert finish_reason("stop", False) == "stop"


def test_an_unknown_parser_is_refused() -> None:
    with pytest.raises(ValueError, match="pythonic"):
        get_tool_parser("pythonic")
