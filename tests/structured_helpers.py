"""A tiny random checkpoint with a byte-level BPE tokenizer (every string is writable, as
with real tokenizers), for structured-output tests: at temperature 1 its random weights
put no structure in the text, so whatever structure the output has is the grammar's."""

from __future__ import annotations

import functools
import json
import tempfile

import torch

from conveyor.config.presets import CHATML_TEMPLATE

VOCAB = 384
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 (pad, bos, eos)

# Text the BPE merges are learnt from: JSON-ish, so some tokens span several characters.
_CORPUS = [json.dumps({"name": f"user{i}", "age": i % 90, "tags": ["a", "bc"], "ok": i % 2 == 0,
                       "city": "Paris" if i % 3 else "Lyon"}) for i in range(200)]


def save_byte_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIALS[0],
                                   bos_token=SPECIALS[1], eos_token=SPECIALS[2])
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(path)


@functools.cache
def byte_checkpoint(seed: int = 0) -> str:
    """A 2-layer llama with hidden 64 and the byte-level tokenizer; cached per session."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=112,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = tempfile.mkdtemp(prefix="conveyor-bytes-")
    model.save_pretrained(path, safe_serialization=True)
    save_byte_tokenizer(path)
    return path


def strict_json(text: str):
    """RFC 8259's parse: raw control characters inside strings are errors."""
    return json.loads(text, strict=True)
