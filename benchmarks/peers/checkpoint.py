"""The shared checkpoint: SmolLM2-135M-shaped random weights and a byte-level BPE tokenizer.

Written once per seed under ``<cache>/peers/checkpoints`` with transformers'
``save_pretrained`` (safetensors, float32), deterministic from the seed. Every
server casts it to the benchmark dtype itself; llama.cpp gets GGUF files converted
from this very folder (gguf.py).

Why a byte-level BPE tokenizer and not the preset's synthetic WordLevel one:
llama.cpp's converter accepts SentencePiece, BPE (with merges) or WordPiece vocabularies,
and vLLM rejects prompt ids at or above the tokenizer's size, so the tokenizer must be
a BPE with exactly the model's 49,152 entries. It is built, not trained: three special
tokens (ids 0-2 as in SmolLM2: endoftext, im_start, im_end), the 256 byte symbols, then
two-symbol merges in a fixed order until the vocabulary is full. Prompts are sent as
token ids, so the merges' quality is irrelevant; the text it decodes to is gibberish
either way.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PRESET = "smollm2-135m"
FORMAT_VERSION = 1  # bump when the files written here change


def bpe_vocab(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Specials, the byte alphabet, then merges of two byte symbols: exactly ``vocab_size``."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte symbols
    tokens = [*SPECIAL_TOKENS, *alphabet]
    if vocab_size < len(tokens) or vocab_size > len(tokens) + len(alphabet) ** 2:
        raise ValueError(f"vocab_size {vocab_size} outside [{len(tokens)}, "
                         f"{len(tokens) + len(alphabet) ** 2}] for a two-byte BPE")
    merges: list[tuple[str, str]] = []
    for a in alphabet:
        for b in alphabet:
            if len(tokens) == vocab_size:
                break
            merges.append((a, b))
            tokens.append(a + b)
    return {t: i for i, t in enumerate(tokens)}, merges


def save_bpe_tokenizer(path: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from conveyor.model.presets import CHATML_TEMPLATE

    vocab, merges = bpe_vocab(vocab_size)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(path)


def recipe(seed: int) -> dict:
    from conveyor.model.presets import preset_config

    return {"preset": PRESET, "config": preset_config(PRESET), "seed": seed,
            "init": "transformers default", "weights": "float32 safetensors",
            "tokenizer": "two-byte BPE", "format": FORMAT_VERSION}


def checkpoint_dir(root: str, seed: int) -> str:
    key = hashlib.sha256(json.dumps(recipe(seed), sort_keys=True).encode()).hexdigest()[:10]
    return os.path.join(root, "checkpoints", f"{PRESET}-random-seed{seed}-{key}")


def ensure_checkpoint(root: str, seed: int) -> str:
    """The checkpoint folder for ``seed``, written (atomically) if it is not there yet."""
    path = checkpoint_dir(root, seed)
    if os.path.isfile(os.path.join(path, "recipe.json")):
        return path
    import torch
    import transformers as tf

    rec = recipe(seed)
    print(f"writing the random {PRESET} checkpoint (seed {seed}) to {path}", flush=True)
    tmp = path + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    config = tf.LlamaConfig(**rec["config"])
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(config).to(torch.float32)
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
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with open(log_path, "a") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    if rc != 0 or not os.path.isfile(out):
        raise RuntimeError(f"GGUF conversion ({outtype}) failed (exit {rc}); see {log_path}")
    return out
