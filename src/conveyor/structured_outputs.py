"""What a request's output must match (vLLM's ``StructuredOutputsParams``): a JSON schema,
any JSON object, a regex, one of several strings, or a Lark grammar.

Plain data that crosses to the engine core inside ``SamplingParams``; the grammar engine
(llguidance, chosen in docs/results/structured_outputs.md) is imported only where a
grammar is built: ``grammar()`` here for the front end's check, and the runner's matcher.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# The kinds a request may ask for; exactly one is set.
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass
class StructuredOutputsParams:
    # A JSON schema: a dict, or its text (kept as canonical text so it crosses as msgpack).
    json: str | dict[str, Any] | None = None
    json_object: bool | None = None  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark (llguidance's dialect); GBNF is converted
    # vLLM's (xgrammar's) structural tag, as JSON text or a dict: free text in which each
    # of ``triggers`` starts a structure ``begin`` + JSON per ``schema`` + ``end``.
    structural_tag: str | dict[str, Any] | None = None
    # JSON whitespace: False (vLLM's --structured-outputs-config disable_any_whitespace
    # default off) writes compact JSON; a random model can otherwise pad forever.
    whitespace_flexible: bool = False
    # A thinking model's reasoning comes first (the server's --reasoning-parser): any text
    # up to the first ``</think>``, then whitespace, then the constraint. With
    # ``reasoning_optional`` (qwen3: it thinks only if it opens with ``<think>``) the block
    # is ``<think>...</think>`` or absent, and then the constraint applies from the start.
    after_reasoning: bool = False
    reasoning_optional: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = _dumps(self.json)
        if isinstance(self.structural_tag, dict):
            self.structural_tag = _dumps(self.structural_tag)
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(KINDS)}; got {set_kinds or 'none'}")
        if self.structural_tag is not None:
            _struct_tags(self.structural_tag)  # its shape, checked with the message's fields
        if self.choice is not None and not (
                isinstance(self.choice, list) and self.choice
                and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of "
                             "non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """The compiled-grammar cache's key: equal for equal constraints."""
        return (f"{self.kind}|{self.whitespace_flexible}|{self.after_reasoning}|"
                f"{self.reasoning_optional}|{_dumps(getattr(self, self.kind))}")

    def grammar_text(self) -> str:
        """llguidance's grammar (its JSON form) for this constraint; ValueError naming
        what the engine cannot honour (an unsupported schema keyword, a bad regex)."""
        import llguidance

        m = llguidance.LLMatcher
        kind = self.kind
        defaults = {"whitespace_flexible": self.whitespace_flexible}
        if self.after_reasoning:
            return self._after_reasoning(m, kind, defaults)
        if kind == "json":
            try:
                schema = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("structured_outputs.json must be a JSON schema object")
            text = m.grammar_from_json_schema(schema, defaults=defaults)
        elif kind == "json_object":
            text = m.grammar_from_json_schema({"type": "object"}, defaults=defaults)
        elif kind == "regex":
            text = m.grammar_from_regex(self.regex)
        elif kind == "choice":
            # Lark string literals, quoted as JSON strings are.
            text = m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        elif kind == "structural_tag":
            # llguidance's own translation: lazy trigger lexemes over free text, each
            # followed by its begin, its schema's JSON and its end (triggers as text).
            lark = llguidance.StructTag.to_grammar(_struct_tags(self.structural_tag),
                                                   assume_special=False)
            text = lark if lark.lstrip().startswith("{") else m.grammar_from_lark(lark)
        else:
            from llguidance.gbnf_to_lark import any_to_lark

            try:  # GBNF (llama.cpp's, vLLM's guided_grammar) is converted to Lark
                src = any_to_lark(self.grammar)
            except Exception as e:  # the converter's own error type, or a parse failure
                raise ValueError(f"structured_outputs.grammar: {e}") from None
            text = m.grammar_from_lark(src)
        error = m.validate_grammar(text)
        if error:
            raise ValueError(f"structured_outputs.{kind}: {error.strip()}")
        return text


    def _after_reasoning(self, m: Any, kind: str, defaults: dict[str, Any]) -> str:
        # Lark: the reasoning is the shortest text ending in </think> ([lazy]).
        if kind in ("json", "json_object"):
            schema = json.loads(self.json) if kind == "json" else {"type": "object"}
            if not isinstance(schema, dict):
                raise ValueError("structured_outputs.json must be a JSON schema object")
            answer = "%json " + json.dumps({**schema, "x-guidance": defaults})
        elif kind == "regex":
            answer = "/" + self.regex.replace("/", "\\/") + "/"
        elif kind == "choice":
            answer = " | ".join(json.dumps(c) for c in self.choice)
        else:
            raise ValueError(f"structured_outputs.{kind} cannot follow a reasoning block "
                             "(--reasoning-parser); json, regex and choice can")
        if self.reasoning_optional:  # an opened block, or the answer at once
            start = "start: think REASONING_WS answer | answer\n" \
                    "think[lazy]: /<think>(?s:.*)<\\/think>/\n"
        else:
            start = "start: think REASONING_WS answer\nthink[lazy]: /(?s:.*)<\\/think>/\n"
        text = m.grammar_from_lark(start + "REASONING_WS: /[ \\n]*/\n" + f"answer: {answer}")
        error = m.validate_grammar(text)
        if error:
            raise ValueError(f"structured_outputs.{kind}: {error.strip()}")
        return text


def _struct_tags(text: str) -> list:
    """llguidance ``StructTag``s of a structural tag's JSON text (``{"structures": [{"begin",
    "schema", "end"}], "triggers": [...]}``); ValueError naming the field at fault."""
    name = "structured_outputs.structural_tag"
    try:
        tag = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(tag, dict):
        raise ValueError(f"{name} must be an object with 'structures' and 'triggers'")
    unknown = sorted(set(tag) - {"type", "structures", "triggers"})
    if unknown or tag.get("type", "structural_tag") != "structural_tag":
        raise ValueError(f"{name}: only the 'structures' + 'triggers' form is supported "
                         f"(got {unknown[0] if unknown else 'type ' + repr(tag['type'])})")
    triggers, structures = tag.get("triggers"), tag.get("structures")
    if not (isinstance(triggers, list) and triggers
            and all(isinstance(t, str) and t for t in triggers)):
        raise ValueError(f"{name}.triggers must be a non-empty list of non-empty strings")
    if not (isinstance(structures, list) and structures):
        raise ValueError(f"{name}.structures must be a non-empty list")
    import llguidance

    tags = []
    for i, st in enumerate(structures):
        where = f"{name}.structures[{i}]"
        if not (isinstance(st, dict) and isinstance(st.get("begin"), str)
                and isinstance(st.get("end"), str) and isinstance(st.get("schema"), dict)):
            raise ValueError(f"{where} must have a string 'begin' and 'end' and a JSON "
                             "schema object 'schema'")
        trigger = max((t for t in triggers if st["begin"].startswith(t)), key=len, default=None)
        if trigger is None:
            raise ValueError(f"{where}.begin {st['begin']!r} starts with none of the triggers")
        tags.append(llguidance.StructTag(trigger=trigger, begin=st["begin"],
                                         grammar=st["schema"], end=st["end"]))
    return tags


def _dumps(value: Any) -> str:
    # Key order kept: a schema's property order is the output's.
    return value if isinstance(value, str) else json.dumps(value)
