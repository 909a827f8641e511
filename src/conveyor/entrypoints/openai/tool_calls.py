"""Tool calling on /v1/chat/completions, as vLLM serves it.

- ``tool_choice`` "none": tools are left out of the prompt and the output is text.
- "auto" (the default with tools; needs ``--enable-auto-tool-choice`` and a
  ``--tool-call-parser``): the model decides; the parser finds calls in its text.
- "required" and a named function: a grammar forces the output, so every call's arguments
  parse and match the function's parameters. Required: a JSON array of
  ``{"name": ..., "parameters": {...}}`` (one item when ``parallel_tool_calls`` is false);
  named: the function's arguments object itself.

Whole and streamed results come from one parse of the text so far (``ToolCallStream``):
a call's name is sent first, then its arguments as deltas; ``finish_reason`` is
"tool_calls" when a call was made.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from conveyor.entrypoints.openai.errors import OpenAIError
from conveyor.entrypoints.openai.tool_parsers import Parsed, ToolCallDraft, ToolParser
from conveyor.entrypoints.openai.tool_parsers.mistral import MARKER, MistralToolParser
from conveyor.structured_outputs import StructuredOutputsParams

_ANY_OBJECT = {"type": "object"}


@dataclass
class ToolPlan:
    mode: str  # "auto" | "required" | "named"
    tools: list[dict[str, Any]]  # the request's tools, for the chat template
    parser: ToolParser | None = None  # auto
    function: str | None = None  # named
    structured: StructuredOutputsParams | None = None  # required, named


def plan_tools(req: Any, parser_name: str | None, auto_enabled: bool) -> ToolPlan | None:
    """The request's tool plan (None: no tools in play); OpenAIError 400 naming the field."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise OpenAIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    functions = _check_tools(req.tools)
    if choice is None:
        choice = "auto"
    if choice == "none":
        return None
    if choice == "auto":
        if not (auto_enabled and parser_name):
            raise OpenAIError(400, 'tool_choice "auto" needs a server started with '
                                   "--enable-auto-tool-choice and --tool-call-parser",
                              param="tool_choice")
        from conveyor.entrypoints.openai.tool_parsers import get_tool_parser

        return ToolPlan("auto", req.tools, parser=get_tool_parser(parser_name))
    if choice == "required":
        items = [{"type": "object",
                  "properties": {"name": {"const": name}, "parameters": params},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, params in functions.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if req.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", req.tools, structured=_structured(schema))
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise OpenAIError(400, f"tool_choice names function {name!r}, which is not in "
                                   f"tools ({', '.join(functions)})", param="tool_choice")
        return ToolPlan("named", req.tools, function=name,
                        structured=_structured(functions[name]))
    raise OpenAIError(400, f"tool_choice {choice!r} is not one of none, auto, required or "
                           '{"type": "function", "function": {"name": ...}}',
                      param="tool_choice")


def _check_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters' JSON schema."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise OpenAIError(400, f"tools[{i}] must be {{\"type\": \"function\", "
                                   "\"function\": {\"name\": ..., \"parameters\": ...}}",
                              param="tools")
        params = fn.get("parameters") or _ANY_OBJECT
        if not isinstance(params, dict):
            raise OpenAIError(400, f"tools[{i}].function.parameters must be a JSON schema "
                                   "object", param="tools")
        out[fn["name"]] = params
    return out


def _structured(schema: dict[str, Any]) -> StructuredOutputsParams:
    params = StructuredOutputsParams(json=schema)
    try:
        params.grammar_text()
    except ValueError as e:  # an unsupported keyword in a function's parameters
        raise OpenAIError(400, f"tools: {e}", param="tools") from None
    return params


# ---- results -------------------------------------------------------------------------------
@dataclass
class ToolCallStream:
    """One choice's tool calls: ``update(text so far, final)`` gives the content delta and
    the tool-call deltas not sent yet (OpenAI's shape: the first delta of a call carries
    its id, type and name; later ones carry arguments)."""

    plan: ToolPlan
    content_sent: int = 0
    ids: list[str] = field(default_factory=list)
    args_sent: list[int] = field(default_factory=list)
    parsed: Parsed | None = None

    def parse(self, text: str, final: bool) -> Parsed:
        plan = self.plan
        if plan.mode == "named":
            return Parsed("", [ToolCallDraft(plan.function, text, final)])
        if plan.mode == "required":
            return MistralToolParser().parse(MARKER + text, final)
        parsed = plan.parser.parse(text, final)
        if final and not any(c.name for c in parsed.calls):
            return Parsed(text)  # no call after all: the whole text is content
        return parsed

    def update(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        parsed = self.parse(text, final)
        self.parsed = parsed
        content = parsed.content[self.content_sent:]
        self.content_sent = max(self.content_sent, len(parsed.content))
        deltas: list[dict[str, Any]] = []
        for i, call in enumerate(parsed.calls):
            if call.name is None:
                break
            if i == len(self.ids):
                self.ids.append(f"chatcmpl-tool-{uuid.uuid4().hex[:24]}")
                self.args_sent.append(0)
                deltas.append({"index": i, "id": self.ids[i], "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            new = call.arguments[self.args_sent[i]:]
            if new:
                self.args_sent[i] = len(call.arguments)
                deltas.append({"index": i, "function": {"arguments": new}})
        return content, deltas

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The whole message: (content or None, tool calls)."""
        self.update(text, final=True)
        calls = [{"id": self.ids[i], "type": "function",
                  "function": {"name": c.name, "arguments": c.arguments}}
                 for i, c in enumerate(self.parsed.calls) if c.name is not None]
        content = self.parsed.content
        return (content or None) if calls else content, calls

    @property
    def made_calls(self) -> bool:
        return bool(self.ids)


def finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """"tool_calls" where the model stopped after making calls (not cut by length)."""
    return "tool_calls" if made_calls and reason == "stop" else reason

