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


@pytest.mark.parametrize("seed", range(20))
def test_incremental_detokenization_adds_up_to_the_whole_decode(pair, seed: int) -> None:
    """Deltas fed in chunks of any size add up to the decode of the whole sequence (less
    the prompt context's own text), whether the detokenizer owns its list or reads the
    caller's."""
    from conveyor.engine.detokenizer import IncrementalDetokenizer

    ours, _ = pair
    rng = random.Random(seed)
    prompt = [rng.randrange(3, ours.vocab_size) for _ in range(rng.randint(1, 9))]
    outputs = [rng.randrange(3, ours.vocab_size) for _ in range(rng.randint(1, 30))]
    shared: list[int] = []
    reader = IncrementalDetokenizer(ours, prompt, outputs=shared)
    owner = IncrementalDetokenizer(ours, prompt)
    i = 0
    while i < len(outputs):
        chunk = outputs[i:i + rng.randint(1, 4)]
        i += len(chunk)
        shared.extend(chunk)
        assert reader.add(chunk) == owner.add(chunk)
    context = prompt[-5:]
    whole = ours.decode(context + outputs, skip_special_tokens=True)
    head = ours.decode(context, skip_special_tokens=True)
    if not whole.endswith("\ufffd") and whole.startswith(head):
        assert reader.text == owner.text == whole[len(head):]
    assert owner.outputs == outputs and reader.outputs is shared
