"""A request's output constraint from its HTTP fields: OpenAI's ``response_format``
(json_schema, json_object, text; vLLM's structural_tag), vLLM's ``structured_outputs``
and its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``.

At most one of them may constrain a request. Whatever the grammar engine cannot honour
(an unsupported JSON-schema keyword, a bad regex) is a 400 naming the field it came in.
"""

from __future__ import annotations

from typing import Any

from conveyor.entrypoints.openai.errors import OpenAIError
from conveyor.structured_outputs import KINDS, StructuredOutputsParams

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
# vLLM's structured_outputs keys that change nothing here (accepted when false/empty).
_NEUTRAL = {"disable_fallback", "disable_additional_properties"}


def structured_outputs_of(req: Any) -> StructuredOutputsParams | None:
    """The constraint ``req`` asks for (None: free text); OpenAIError 400 naming the field."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None:
        params = _from_response_format(fmt)
        if params is not None:
            found.append(("response_format", params))
    raw = getattr(req, "structured_outputs", None)
    if raw is not None:
        found.append(("structured_outputs", _from_vllm(raw)))
    for name, kind in _GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            found.append((name, _make(name, {kind: value})))
    if len(found) > 1:
        names = [n for n, _ in found]
        raise OpenAIError(400, f"{' and '.join(names)} both constrain the output; send one",
                          param=names[1])
    if not found:
        return None
    name, params = found[0]
    try:
        params.grammar_text()  # what llguidance cannot honour, named now
    except ValueError as e:
        raise OpenAIError(400, f"{name}: {e}", param=name) from None
    return params


def _from_response_format(fmt: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "structural_tag":  # vLLM's: structures and triggers beside the type
        return _make("response_format", {"structural_tag": dict(fmt)})
    if kind != "json_schema":
        raise OpenAIError(400, f"response_format.type {kind!r} is not supported (text, "
                               "json_object, json_schema, structural_tag)",
                          param="response_format.type")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise OpenAIError(400, "response_format.json_schema must be an object with a "
                               "'schema'", param="response_format.json_schema")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise OpenAIError(400, "response_format.json_schema.schema must be a JSON schema "
                               "object", param="response_format.json_schema.schema")
    # strict true or false: the output matches the schema either way (a grammar cannot
    # half-follow one), which is what strict promises.
    return _make("response_format", {"json": schema})


def _from_vllm(raw: Any) -> StructuredOutputsParams:
    if not isinstance(raw, dict):
        raise OpenAIError(400, "structured_outputs must be an object", param="structured_outputs")
    fields = dict(raw)
    for key in _NEUTRAL:
        if not fields.pop(key, False):
            continue
        raise OpenAIError(400, f"structured_outputs.{key} is not supported",
                          param=f"structured_outputs.{key}")
    unknown = sorted(set(fields) - set(KINDS) - {"whitespace_flexible"})
    if unknown:
        raise OpenAIError(400, f"structured_outputs.{unknown[0]} is not supported (one of "
                               f"{', '.join(KINDS)})", param=f"structured_outputs.{unknown[0]}")
    return _make("structured_outputs", fields)


def _make(name: str, fields: dict[str, Any]) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except (TypeError, ValueError) as e:
        raise OpenAIError(400, f"{name}: {e}", param=name) from None
