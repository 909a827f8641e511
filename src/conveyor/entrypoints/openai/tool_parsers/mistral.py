"""Mistral: content, then ``[TOOL_CALLS]`` and a JSON array of
``{"name": ..., "arguments": {...}}``."""

from __future__ import annotations

from conveyor.entrypoints.openai.tool_parsers.base import (
    Parsed,
    ToolParser,
    held_back,
    scan_call,
    scan_object,
)

MARKER = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"

    def parse(self, text: str, final: bool) -> Parsed:
        at = text.find(MARKER)
        if at < 0:
            keep = 0 if final else held_back(text, MARKER)
            return Parsed(text[:len(text) - keep])
        out = Parsed(text[:at])
        body = text[at + len(MARKER):].lstrip()
        if not body.startswith("["):
            return out
        pos = 1
        while True:
            while pos < len(body) and body[pos] in " \n\t,":
                pos += 1
            if pos >= len(body) or body[pos] != "{":
                break
            end = scan_object(body, pos)
            draft = scan_call(body[pos:end if end is not None else len(body)])
            draft.complete = draft.complete and end is not None
            out.calls.append(draft)
            if end is None:
                break
            pos = end
        return out
