"""Phi-3: Llama's decoder; its checkpoint packs Q/K/V (``qkv_proj``) and gate/up
(``gate_up_proj``) already (the loader reads each shard out of them), and its sliding
window is on where config.json sets one. Its ``longrope`` scaling and partial rotary
embeddings (Phi-3.5/Phi-4-mini) are refused by ``layers/rotary.py`` with their names."""

from __future__ import annotations

from conveyor.model.models.decoder import DecoderForCausalLM, FamilyTraits


class Phi3ForCausalLM(DecoderForCausalLM):
    traits = FamilyTraits(sliding_window=True)


MODEL = Phi3ForCausalLM
