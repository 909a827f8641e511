"""The front end's tokenizer: a checkpoint's ``tokenizer.json`` run by the ``tokenizers``
library directly, with the special tokens of its ``tokenizer_config.json``.

transformers' tokenizer classes import torch (its configuration module does), and the
API server process must not: it never runs a model. For a fast tokenizer (every
Llama/Mistral/Qwen checkpoint has a ``tokenizer.json``) transformers' own encode and
decode are this same Rust tokenizer (``tests/test_tokenizer.py`` checks they agree);
a checkpoint without one falls back on transformers, torch and all.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


def _content(token: Any) -> str | None:
    if token is None or isinstance(token, str):
        return token
    if isinstance(token, dict):
        return token.get("content")
    return str(token)


class FastTokenizer:
    """The subset of a Hugging Face fast tokenizer that conveyor's front end uses."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer

        self.path = path
        self._tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        config: dict[str, Any] = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            with open(cfg_file) as f:
                config = json.load(f)
        for name in _SPECIAL_NAMES:
            setattr(self, name, _content(config.get(name)))
        self.chat_template = config.get("chat_template")
        # transformers cleans up spaces for WordPiece-style tokenizers only (never BPE).
        self.clean_up_tokenization_spaces = bool(
            config.get("clean_up_tokenization_spaces", False)) \
            and type(self._tok.model).__name__ != "BPE"

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_tokenization_spaces else text

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self._tok.id_to_token(i) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab(with_added_tokens=True)


def _clean_up(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (spaces before punctuation, contractions)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                 (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                 (" 're", "'re")):
        text = text.replace(a, b)
    return text


def load_tokenizer(path: str) -> Any:
    """The tokenizer in a local folder (never the hub): ``FastTokenizer`` where the folder
    has a ``tokenizer.json``, else transformers' (which imports torch)."""
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return FastTokenizer(path)
    logger.warning("%s has no tokenizer.json: loading it with transformers (imports torch)",
                   path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
