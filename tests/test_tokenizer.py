"""The front end's tokenizer (``tokenizers`` on tokenizer.json, no transformers, no torch)
encodes and decodes exactly as transformers' tokenizer of the same checkpoint."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from conveyor.engine.tokenizer import FastTokenizer, load_tokenizer

from helpers import make_checkpoint

TEXTS = ["ba be bi bo", "  leading and  double  spaces", "ünïcödé and emoji 🙂", "",
         "<|endoftext|> special in text", "da\nde\tdi do du fa"]


@pytest.fixture(scope="module")
def pair():
    path = make_checkpoint("llama")
    return FastTokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("special", [False, True])
def test_encode_agrees_with_transformers(pair, text: str, special: bool) -> None:
    ours, theirs = pair
    assert ours.encode(text, add_special_tokens=special) == \
        theirs.encode(text, add_special_tokens=special)


def test_decode_and_vocab_agree_with_transformers(pair) -> None:
    ours, theirs = pair
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 12))]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == \
                theirs.decode(ids, skip_special_tokens=skip), (ids, skip)
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.convert_ids_to_tokens([5, 6, 7]) == theirs.convert_ids_to_tokens([5, 6, 7])
    for name in ("bos_token", "eos_token"):
        assert getattr(ours, name) == getattr(theirs, name)


def test_a_folder_without_tokenizer_json_falls_back_on_transformers(tmp_path) -> None:
    assert isinstance(load_tokenizer(make_checkpoint("llama")), FastTokenizer)
    with pytest.raises((OSError, ValueError)):  # nothing to load: transformers says so
        load_tokenizer(str(tmp_path))
