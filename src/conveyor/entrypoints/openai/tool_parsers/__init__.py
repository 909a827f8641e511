"""Tool-call parsers by ``--tool-call-parser`` name (one module per format)."""

from __future__ import annotations

from conveyor.entrypoints.openai.tool_parsers.base import Parsed, ToolCallDraft, ToolParser

TOOL_PARSERS = {"hermes": "hermes:HermesToolParser",
                "llama3_json": "llama3_json:Llama3JsonToolParser",
                "mistral": "mistral:MistralToolParser"}


def get_tool_parser(name: str) -> ToolParser:
    import importlib

    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not one of {', '.join(TOOL_PARSERS)}")
    module, cls = TOOL_PARSERS[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)()


__all__ = ["TOOL_PARSERS", "Parsed", "ToolCallDraft", "ToolParser", "get_tool_parser"]
