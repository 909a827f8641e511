"""Tokenizer loading and incremental detokenization with stop strings."""

from __future__ import annotations

from typing import Any

# Prompt tokens kept as left context so the first output token decodes with the right
# leading space (tokenizers decide spacing from neighbours).
_CONTEXT_TOKENS = 5


def load_tokenizer(path: str) -> Any:
    """The front end's tokenizer from a local folder (never the hub): see tokenizer.py."""
    from conveyor.engine.tokenizer import load_tokenizer as load

    return load(path)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Decodes a short window of ``context + outputs`` from ``prefix_offset`` against the
    same window up to ``read_offset`` and emits the difference, holding back text that
    ends in an incomplete UTF-8 sequence. ``outputs`` is the caller's list (the front
    end's one copy of a sample's tokens), read, never appended to here.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True, outputs: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.outputs = outputs if outputs is not None else []
        self._owns_outputs = outputs is None
        self.prefix_offset = 0
        self.read_offset = len(self.context)
        self.text = ""

    def _window(self, start: int, end: int | None = None) -> list[int]:
        """Positions ``[start, end)`` of context + outputs."""
        c = len(self.context)
        end = c + len(self.outputs) if end is None else end
        if start >= c:
            return self.outputs[start - c:end - c]
        return self.context[start:end] + self.outputs[:max(end - c, 0)]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Tokens just appended to ``outputs`` (appended here if this owns the list);
        returns the text they complete (possibly empty)."""
        if self._owns_outputs:
            self.outputs.extend(token_ids)
        c = len(self.context)
        first_new = c + len(self.outputs) - len(token_ids)
        delta = ""
        for pos in range(first_new + 1, c + len(self.outputs) + 1):  # one token at a time
            prefix_text = self._decode(self._window(self.prefix_offset, self.read_offset))
            new_text = self._decode(self._window(self.prefix_offset, pos))
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                delta += new_text[len(prefix_text):]
                self.prefix_offset = self.read_offset
                self.read_offset = pos
        self.text += delta
        return delta

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def find_stop_string(text: str, num_new_chars: int, stops: list[str],
                     include: bool) -> tuple[str, int] | None:
    """Earliest stop string that ends inside the new text: (stop, where to cut the text)."""
    hits = []
    for stop in stops:
        idx = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if idx != -1:
            hits.append((idx, stop))
    if not hits:
        return None
    idx, stop = min(hits)
    return stop, idx + len(stop) if include else idx
