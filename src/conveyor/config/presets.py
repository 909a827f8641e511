"""Built-in model shapes for dummy-weight runs, and a synthetic tokenizer for them.

``--model smollm2-135m --load-format dummy`` needs no download: the preset's
config.json and a word-level tokenizer of the right vocabulary size are written
once to a cache folder and loaded like any checkpoint. Text from random weights
is gibberish either way; the tokenizer only has to round-trip.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os

from conveyor import envs

_COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-5, "torch_dtype": "float32",
           "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}

PRESETS: dict[str, dict] = {
    # A model so small that a step costs about the same at any batch size.
    "tiny": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 4096, "rope_theta": 10000.0,
             "tie_word_embeddings": False},
    "smollm2-135m": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                     "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                     "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "head_dim": 64,
                     "max_position_embeddings": 8192, "rope_theta": 100000.0,
                     "tie_word_embeddings": True},
    "qwen3-0.6b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                   "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128,
                   "max_position_embeddings": 40960, "rope_theta": 1000000.0,
                   "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
    "llama3-8b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                  "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
                  "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "max_position_embeddings": 131072,
                  "rope_theta": 500000.0, "tie_word_embeddings": False,
                  "torch_dtype": "bfloat16",
                  "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}},
    "llama3-70b": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
                   "num_hidden_layers": 80, "num_attention_heads": 64,
                   "num_key_value_heads": 8, "max_position_embeddings": 131072,
                   "rope_theta": 500000.0, "tie_word_embeddings": False,
                   "torch_dtype": "bfloat16",
                   "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}},
}

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def preset_config(name: str) -> dict:
    return {**_COMMON, **PRESETS[name]}


def cache_root() -> str:
    return envs.cache_root()


def resolve_model_path(model: str, load_format: str) -> str:
    """A checkpoint folder as is; a preset name materialized (config + tokenizer) in the cache."""
    if os.path.isdir(model):
        return model
    if model in PRESETS:
        if load_format not in ("auto", "dummy"):
            raise ValueError(f"built-in shape {model!r} has no weights: use load_format='dummy'")
        cfg = preset_config(model)
        key = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:10]
        path = os.path.join(cache_root(), "presets", f"{model}-{key}")
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            write_checkpoint_files(path, cfg)
        return path
    raise ValueError(f"model {model!r} is neither a folder nor a built-in shape; built-in "
                     f"shapes: {', '.join(PRESETS)}")


def write_checkpoint_files(path: str, hf_config: dict) -> None:
    """Write config.json and a synthetic tokenizer (no weights) into ``path``."""
    os.makedirs(path, exist_ok=True)
    tmp = path + f".tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=1)
    save_synthetic_tokenizer(tmp, hf_config["vocab_size"])
    for name in os.listdir(tmp):
        os.replace(os.path.join(tmp, name), os.path.join(path, name))
    os.rmdir(tmp)


def synthetic_vocab(vocab_size: int) -> list[str]:
    """Special tokens, punctuation, digits, then pronounceable words: exactly vocab_size."""
    words = [*SPECIAL_TOKENS, *".,!?;:'\"()-", *"0123456789"]
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    for n in itertools.count(1):
        for combo in itertools.product(syllables, repeat=n):
            if len(words) >= vocab_size:
                return words[:vocab_size]
            words.append("".join(combo))
    raise AssertionError("unreachable")


def save_synthetic_tokenizer(path: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < len(SPECIAL_TOKENS) + 64:
        raise ValueError(f"vocab_size {vocab_size} too small for the synthetic tokenizer")
    vocab = {w: i for i, w in enumerate(synthetic_vocab(vocab_size))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", unk_token="<unk>",
                                   pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|endoftext|>"]})
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(path)
