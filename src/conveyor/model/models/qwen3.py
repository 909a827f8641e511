"""Qwen3: Llama's decoder with per-head RMS norms of q and k before the rotation."""

from __future__ import annotations

from conveyor.model.models.decoder import DecoderForCausalLM, FamilyTraits


class Qwen3ForCausalLM(DecoderForCausalLM):
    traits = FamilyTraits(qk_norm=True)


MODEL = Qwen3ForCausalLM
