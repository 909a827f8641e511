"""The model's shape and dtype, read from a checkpoint's config.json (no torch, no weights)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from conveyor.config.quantization import resolve_kv_cache_dtype, resolve_quantization

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "GraniteForCausalLM",
    "Olmo2ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)
# What transformers' Auto classes fall back on when config.json names no architecture
# (AutoConfig.for_model(...).save_pretrained() writes none).
ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    path: str  # folder with config.json (and weights unless load_format is dummy)
    architecture: str
    hf_config: dict[str, Any] = field(repr=False, hash=False, compare=False)
    dtype: str  # resolved: float32 | bfloat16 | float16
    load_format: str  # auto | safetensors | dummy
    seed: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    tokenizer: str | None  # folder with tokenizer files; None: token ids only
    served_model_name: str
    # The arithmetic's (and the KV cache's) dtype when it differs from the weights' dtype:
    # float32 on bf16-rounded weights for a CPU without bf16 instructions (model/dtypes.py).
    compute_dtype: str | None = None
    # Quantized weights (config/quantization.py): int8 at load, or the checkpoint's format.
    quantization: str | None = None
    # The KV pool's elements: auto (the compute dtype) or one byte plus a float32 scale
    # per token and head (fp8_e4m3, fp8_e5m2, int8; model/quant/kv_cache.py).
    kv_cache_dtype: str = "auto"

    @property
    def math_dtype(self) -> str:
        return self.compute_dtype or self.dtype

    @property
    def dtype_label(self) -> str:
        """``bfloat16`` or, computing in another dtype, ``bfloat16 (float32 compute)``."""
        if self.math_dtype == self.dtype:
            return self.dtype
        return f"{self.dtype} ({self.math_dtype} compute)"

    @property
    def kv_bytes_per_token(self) -> int:
        itemsize = 4 if self.math_dtype == "float32" else 2
        if self.kv_cache_dtype != "auto":  # one byte an element, a float32 scale a head
            return 2 * self.num_layers * self.num_kv_heads * (self.head_dim + 4)
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize



def kv_hash_key(model: ModelConfig) -> bytes:
    """What the prefix cache's block hashes are salted with: the same tokens under another
    checkpoint, arithmetic dtype, weights or seed have other K/V."""
    return (f"{model.path}|{model.math_dtype}|{model.load_format}|{model.seed}"
            + (f"|{model.quantization}" if model.quantization else "")
            + (f"|kv:{model.kv_cache_dtype}" if model.kv_cache_dtype != "auto" else "")
            ).encode()



def load_model_config(path: str, *, dtype: str = "auto", load_format: str = "auto",
                      seed: int = 0, max_model_len: int | None = None,
                      tokenizer: str | None = None,
                      served_model_name: str | None = None,
                      quantization: str | None = None,
                      kv_cache_dtype: str = "auto") -> ModelConfig:
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"no config.json in {path!r}: --model must be a Hugging Face "
                         "checkpoint folder or a built-in shape name")
    with open(cfg_file) as f:
        hf = json.load(f)
    extra_eos: list[int] = []
    gen_cfg = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_cfg):
        with open(gen_cfg) as f:
            g_eos = json.load(f).get("eos_token_id")
        if g_eos is not None:
            extra_eos = g_eos if isinstance(g_eos, list) else [g_eos]
    tok = tokenizer or (path if _has_tokenizer(path) else None)
    return model_config_from_hf(hf, path, dtype=dtype, load_format=load_format, seed=seed,
                                max_model_len=max_model_len, tokenizer=tok,
                                served_model_name=served_model_name, extra_eos=extra_eos,
                                quantization=quantization, kv_cache_dtype=kv_cache_dtype)


def model_config_from_hf(hf: dict[str, Any], path: str, *, dtype: str = "auto",
                         load_format: str = "auto", seed: int = 0,
                         max_model_len: int | None = None, tokenizer: str | None = None,
                         served_model_name: str | None = None,
                         extra_eos: list[int] | tuple[int, ...] = (),
                         quantization: str | None = None,
                         kv_cache_dtype: str = "auto") -> ModelConfig:
    """A ModelConfig from a parsed config.json (no file access: the simulator uses it)."""
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and not archs:
        arch = ARCHITECTURE_OF_MODEL_TYPE.get(hf.get("model_type", ""))
        if arch is not None:
            logger.warning("config.json names no architecture: %s, from model_type %r",
                           arch, hf.get("model_type"))
    if arch is None:
        found = archs or f"none, model_type {hf.get('model_type')!r}"
        raise ValueError(f"unsupported architecture ({found}); supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)} (or, without "
                         f"'architectures', model_type "
                         f"{', '.join(ARCHITECTURE_OF_MODEL_TYPE)})")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format must be auto, safetensors or dummy, got {load_format!r}")
    if dtype == "auto":
        # The checkpoint's dtype, except float16 on CPU-only builds is slow: bf16 there.
        dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
        if dtype not in DTYPES:
            dtype = "float32"
    num_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    max_pos = int(hf.get("max_position_embeddings", 2048))
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    if extra_eos:
        eos_ids = tuple(dict.fromkeys([*eos_ids, *extra_eos]))
    if max_model_len is not None and max_model_len > max_pos:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                         f"max_position_embeddings {max_pos}")
    return ModelConfig(
        path=path, architecture=arch, hf_config=hf, dtype=dtype, load_format=load_format,
        seed=seed, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"], num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads, head_dim=head_dim,
        intermediate_size=hf["intermediate_size"], max_position_embeddings=max_pos,
        max_model_len=max_model_len or max_pos, eos_token_ids=eos_ids, tokenizer=tokenizer,
        served_model_name=served_model_name or path,
        quantization=resolve_quantization(hf, quantization),
        kv_cache_dtype=resolve_kv_cache_dtype(kv_cache_dtype),
    )


def _has_tokenizer(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f))
               for f in ("tokenizer.json", "tokenizer.model", "vocab.json"))

