"""Mistral: Llama's decoder with sliding-window attention on unless config.json turns it
off (``use_sliding_window``), over its ``sliding_window`` tokens."""

from __future__ import annotations

from conveyor.model.models.decoder import DecoderForCausalLM, FamilyTraits


class MistralForCausalLM(DecoderForCausalLM):
    traits = FamilyTraits(sliding_window=True)


MODEL = MistralForCausalLM
