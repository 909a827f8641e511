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
    """Turns a growing list of token ids into text deltas.

    Decodes a short window ``ids[prefix:]`` against ``ids[prefix:read]`` and emits
    the difference, holding back text that ends in an incomplete UTF-8 sequence.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self.ids: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; returns the text they complete (possibly empty)."""
        delta = ""
        for token in token_ids:
            self.ids.append(token)
            prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
            new_text = self._decode(self.ids[self.prefix_offset:])
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                piece = new_text[len(prefix_text):]
                self.prefix_offset = self.read_offset
                self.read_offset = len(self.ids)
                delta += piece
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
