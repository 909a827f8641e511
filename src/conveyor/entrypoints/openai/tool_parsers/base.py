"""What every tool-call parser shares: its result, and a scanner of one call's JSON object
as far as it has been written.

A parser is a pure function of the text generated so far (``parse(text, final)``): the
stream re-parses after each delta and sends what is new (``tool_calls.ToolCallStream``),
so the whole and the streamed results are the same by construction.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field


@dataclass
class ToolCallDraft:
    """One call as far as the text goes: its name once complete, its arguments' raw JSON
    text so far (only ever grows), ``complete`` when its object has closed."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False


@dataclass
class Parsed:
    """``content``: the text that is not a tool call (so far: a possible start of a call
    at the end is held back while streaming). ``calls``: in order."""

    content: str
    calls: list[ToolCallDraft] = field(default_factory=list)


class ToolParser:
    name = ""

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def scan_object(text: str, start: int) -> int | None:
    """The index just past the JSON value that starts at ``text[start]`` (an object,
    array or string), or None while it is still open."""
    depth, in_str, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def scan_call(text: str, args_keys: tuple[str, ...] = ("arguments", "parameters")
              ) -> ToolCallDraft:
    """One call object ``{"name": ..., "arguments": {...}}`` from its opening brace, as far
    as ``text`` goes. The name must come first to stream; arguments written as a JSON
    string (some models do) are unwrapped once complete."""
    draft = ToolCallDraft()
    m = _NAME.search(text)
    if m is None:
        return draft
    draft.name = json.loads(f'"{m.group(1)}"')
    keys = "|".join(re.escape(k) for k in args_keys)
    a = re.compile(rf'"(?:{keys})"\s*:\s*').search(text, m.end())
    if a is None or a.end() >= len(text):
        return draft
    end = scan_object(text, a.end())
    raw = text[a.end():end] if end is not None else text[a.end():]
    if raw.startswith('"'):  # arguments as a string: only whole
        if end is not None:
            draft.arguments = json.loads(raw)
    else:
        draft.arguments = raw
    if end is not None:
        close = scan_object(text, 0)
        draft.complete = close is not None
    return draft


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker`` (held
    back from streamed content until the next delta says)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
