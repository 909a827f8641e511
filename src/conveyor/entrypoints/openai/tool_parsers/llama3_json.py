"""Llama 3.x JSON tool calls: the whole answer is ``{"name": ..., "parameters": {...}}``
(optionally after ``<|python_tag|>``), several separated by ``;``. Text that does not
start as such an object is content."""

from __future__ import annotations

from conveyor.entrypoints.openai.tool_parsers.base import (
    Parsed,
    ToolParser,
    scan_call,
    scan_object,
)

TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        if body.startswith(TAG):
            body = body[len(TAG):].lstrip()
        elif TAG.startswith(body) and body and not final:
            return Parsed("")  # may be the tag's start
        if not body.startswith("{"):
            if not body and not final:
                return Parsed("")
            return Parsed(text)
        out = Parsed("")
        pos = 0
        while pos < len(body):
            end = scan_object(body, pos)
            draft = scan_call(body[pos:end if end is not None else len(body)],
                              ("parameters", "arguments"))
            draft.complete = draft.complete and end is not None
            out.calls.append(draft)
            if end is None:
                break
            rest = body[end:].lstrip()
            if not rest.startswith(";"):
                break
            rest = rest[1:].lstrip()
            pos = len(body) - len(rest)
        return out
