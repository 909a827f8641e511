"""Qwen2: Llama's decoder with a bias on the Q/K/V projections."""

from __future__ import annotations

from conveyor.model.models.decoder import DecoderForCausalLM, FamilyTraits


class Qwen2ForCausalLM(DecoderForCausalLM):
    traits = FamilyTraits(qkv_bias=True)


MODEL = Qwen2ForCausalLM
