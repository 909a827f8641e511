"""The shared checkpoint: random weights of a model shape (``shapes.py``: SmolLM2-135M by
default, a Gemma-2 or mixture-of-experts shape) and a BPE tokenizer.

Written once per shape and seed under ``<cache>/peers/checkpoints`` with transformers'
``save_pretrained`` (safetensors, float32), deterministic from the seed. Every
server casts it to the benchmark dtype itself; llama.cpp gets GGUF files converted
from this very folder (``ensure_gguf``).

Why this tokenizer and not the preset's synthetic WordLevel one: llama.cpp's converter
takes SentencePiece, BPE (with merges) or WordPiece vocabularies; vLLM rejects prompt
ids at or above the tokenizer's size, so it needs exactly the model's 49,152 entries;
and `transformers serve` takes text prompts only, so decoding a prompt's ids and
encoding the text again must give the very same ids. A byte-level BPE built (not
trained) as words does all three:

    ids 0-2     <|endoftext|> <|im_start|> <|im_end|>   (as in SmolLM2)
    ids 3-15    "Ġ" (a space) and 12 letters a-l         (the base symbols)
    ids 16-     words "Ġ" + 1 to 5 letters, shortest first, until 49,152
    merges      (word minus its last letter, last letter) for every word

Prompt ids are drawn from 16 up (conveyor's workload), so every prompt token is a word
that decodes to " " + letters. The GPT-2 pre-tokenizer splits such text at each space,
and within a word the only merge that can apply is at its left end, so the merges
rebuild exactly that word: encode(decode(ids)) == ids for every prompt (``round_trip_failures``
checks it before text prompts are used).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil

from benchmarks.peers.shapes import model_shape

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
SPACE = "\u0120"  # "Ġ": the byte-level symbol of a space
LETTERS = "abcdefghijkl"
PRESET = "smollm2-135m"
FORMAT_VERSION = 2  # bump when the files written here change


def bpe_vocab(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Specials, base symbols, then words of up to 5 letters: exactly ``vocab_size``."""
    tokens = [*SPECIAL_TOKENS, SPACE, *LETTERS]
    most = len(tokens) + sum(len(LETTERS) ** n for n in range(1, 6))
    if not len(tokens) < vocab_size <= most:
        raise ValueError(f"vocab_size {vocab_size} outside ({len(tokens)}, {most}] for "
                         f"words of up to 5 of {len(LETTERS)} letters")
    merges: list[tuple[str, str]] = []
    for n in range(1, 6):
        for letters in itertools.product(LETTERS, repeat=n):
            if len(tokens) == vocab_size:
                return {t: i for i, t in enumerate(tokens)}, merges
            word = SPACE + "".join(letters)
            merges.append((word[:-1], word[-1]))
            tokens.append(word)
    return {t: i for i, t in enumerate(tokens)}, merges


def round_trip_failures(tokenizer, prompts: list[list[int]]) -> list[int]:
    """Indices of the prompts whose decoded text does not encode back to the same ids
    (encoded as `transformers serve` does: ``tokenizer(text)``, special tokens on)."""
    return [i for i, ids in enumerate(prompts)
            if tokenizer(tokenizer.decode(ids))["input_ids"] != ids]


def save_bpe_tokenizer(path: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from conveyor.config.presets import CHATML_TEMPLATE

    vocab, merges = bpe_vocab(vocab_size)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(path)


def recipe(seed: int, shape: str = "smollm2") -> dict:
    rec = {"preset": PRESET if shape == "smollm2" else shape,
           "config": model_shape(shape).config, "seed": seed,
           "init": "transformers default", "weights": "float32 safetensors",
           "tokenizer": "word BPE", "format": FORMAT_VERSION}
    return rec


def checkpoint_dir(root: str, seed: int, shape: str = "smollm2") -> str:
    rec = recipe(seed, shape)
    key = hashlib.sha256(json.dumps(rec, sort_keys=True).encode()).hexdigest()[:10]
    return os.path.join(root, "checkpoints", f"{rec['preset']}-random-seed{seed}-{key}")


def ensure_checkpoint(root: str, seed: int, shape: str = "smollm2") -> str:
    """The checkpoint folder of ``shape`` (``shapes.py``) for ``seed``, written
    (atomically) if it is not there yet."""
    path = checkpoint_dir(root, seed, shape)
    if os.path.isfile(os.path.join(path, "recipe.json")):
        return path
    import torch
    import transformers as tf

    rec = recipe(seed, shape)
    print(f"writing the random {rec['preset']} checkpoint (seed {seed}) to {path}", flush=True)
    tmp = path + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    fields = {k: v for k, v in rec["config"].items() if k not in ("architectures", "model_type")}
    config = tf.AutoConfig.for_model(rec["config"]["model_type"], **fields)
    config.architectures = rec["config"]["architectures"]
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(tmp, safe_serialization=True)
    save_bpe_tokenizer(tmp, config.vocab_size)
    with open(os.path.join(tmp, "recipe.json"), "w") as f:  # written last: marks complete
        json.dump(rec, f, indent=1)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def ensure_gguf(checkpoint: str, outtype: str, convert_python: str, llama_src: str,
                log_path: str) -> str:
    """``<checkpoint>/gguf/model-<outtype>.gguf``, converted once with llama.cpp's script."""
    import subprocess

    out = os.path.join(checkpoint, "gguf", f"model-{outtype}.gguf")
    if os.path.isfile(out):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "convert_gguf.py")
    cmd = [convert_python, script, llama_src, checkpoint, out, outtype]
    print(f"converting the checkpoint to GGUF ({outtype}): {out}", flush=True)
    # The converter's own folder is its import path (it imports ``conversion`` from there).
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": llama_src}
    with open(log_path, "a") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if rc != 0 or not os.path.isfile(out):
        raise RuntimeError(f"GGUF conversion ({outtype}) failed (exit {rc}); see {log_path}")
    return out
