"""``--reasoning-parser``: a thinking model's ``<think>...</think>`` apart from its answer
(``reasoning_content`` beside ``content``, as vLLM serves it).

- deepseek_r1: everything before ``</think>`` is reasoning (the template may have opened
  the block in the prompt); with no ``</think>`` at all, the whole output is reasoning.
- qwen3: reasoning only when the output opens with ``<think>``; otherwise it is content.

Where the chat template already closed the block at the end of the prompt (Qwen3 with
``chat_template_kwargs: {"enable_thinking": false}`` writes ``<think>\n\n</think>``), the
model does not think: its whole output is content, whatever the parser
(``prompt_thinking``).

A constrained request (a schema, a regex, a choice, a required or named tool call) that
thinks does so first: its grammar lets any text through up to the first ``</think>`` and
constrains what follows (``StructuredOutputsParams.after_reasoning``); a Lark grammar
cannot be wrapped so (400). The block is required with deepseek_r1 (or where the prompt
left it open); with qwen3 it is ``<think>...</think>`` or absent
(``reasoning_optional``). With thinking closed in the prompt, the constraint applies
from the first token.

Like the tool parsers, a function of the text so far; ``ReasoningStream`` re-parses each
delta and sends what is new (the start of ``</think>`` is held back while streaming).
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def prompt_thinking(prompt: str) -> str:
    """How the rendered prompt leaves the think block: "open" (its last ``<think>`` is not
    closed: the output starts inside the block), "closed" (it ends with ``</think>``: the
    template turned thinking off) or "none" (the model decides)."""
    last_open, last_close = prompt.rfind(OPEN), prompt.rfind(CLOSE)
    if last_open > last_close:
        return "open"
    if last_close >= 0 and not prompt[last_close + len(CLOSE):].strip():
        return "closed"
    return "none"


def split_reasoning(parser: str, text: str, final: bool) -> tuple[str, str]:
    """(reasoning so far, content so far) of ``text``."""
    body = text.lstrip()
    if not final and OPEN.startswith(body):
        return "", ""  # may be the opening tag
    opened = body.startswith(OPEN)
    if parser == "qwen3" and not opened:
        return "", text
    if opened:
        body = body[len(OPEN):]
    end = body.find(CLOSE)
    if end >= 0:
        return body[:end], body[end + len(CLOSE):].lstrip("\n")
    keep = 0
    if not final:  # the start of </think> at the end waits for the next delta
        keep = next((k for k in range(min(len(CLOSE) - 1, len(body)), 0, -1)
                     if CLOSE.startswith(body[-k:])), 0)
    return body[:len(body) - keep], ""


@dataclass
class ReasoningStream:
    parser: str
    reasoning_sent: int = 0

    def update(self, text: str, final: bool) -> tuple[str, str]:
        """(the reasoning delta not sent yet, the content so far)."""
        reasoning, content = split_reasoning(self.parser, text, final)
        delta = reasoning[self.reasoning_sent:]
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        return delta, content
