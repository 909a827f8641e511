"""Hugging Face ``architectures`` names to the module of their family, imported on first
use. A family module defines ``MODEL``, its ``DecoderForCausalLM`` subclass; adding a
family is that module plus one line here (and its name in
``conveyor.config.SUPPORTED_ARCHITECTURES``, which config.json is checked against)."""

from __future__ import annotations

import importlib

from conveyor.model.models.decoder import DecoderForCausalLM

FAMILIES = {
    "LlamaForCausalLM": "conveyor.model.models.llama",
    "MistralForCausalLM": "conveyor.model.models.mistral",
    "Qwen2ForCausalLM": "conveyor.model.models.qwen2",
    "Qwen3ForCausalLM": "conveyor.model.models.qwen3",
    "Phi3ForCausalLM": "conveyor.model.models.phi3",
    "GraniteForCausalLM": "conveyor.model.models.granite",
    "Olmo2ForCausalLM": "conveyor.model.models.olmo2",
    "Gemma2ForCausalLM": "conveyor.model.models.gemma2",
    "Gemma3ForCausalLM": "conveyor.model.models.gemma3",
    "MixtralForCausalLM": "conveyor.model.models.mixtral",
    "Qwen3MoeForCausalLM": "conveyor.model.models.qwen3_moe",
}


def model_class(architecture: str) -> type[DecoderForCausalLM]:
    """The model class of ``architecture``; a ValueError listing the supported ones if
    none is registered."""
    module = FAMILIES.get(architecture)
    if module is None:
        raise ValueError(f"unsupported architecture ({architecture!r}); supported: "
                         f"{', '.join(FAMILIES)}")
    return importlib.import_module(module).MODEL
