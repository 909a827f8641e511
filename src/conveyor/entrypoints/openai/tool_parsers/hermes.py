"""Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number,
after optional content."""

from __future__ import annotations

from conveyor.entrypoints.openai.tool_parsers.base import Parsed, ToolParser, held_back, scan_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(OPEN)
        if first < 0:
            keep = 0 if final else held_back(text, OPEN)
            return Parsed(text[:len(text) - keep])
        out = Parsed(text[:first])
        pos = first
        while pos >= 0:
            body_start = pos + len(OPEN)
            end = text.find(CLOSE, body_start)
            body = text[body_start:end if end >= 0 else len(text)].strip()
            brace = body.find("{")
            if brace >= 0:
                draft = scan_call(body[brace:])
                draft.complete = draft.complete and end >= 0
                out.calls.append(draft)
            if end < 0:
                break
            pos = text.find(OPEN, end + len(CLOSE))
        return out
