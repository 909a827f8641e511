"""Gemma 3 (text): Gemma 2's decoder without soft-capping, with per-head (1 + w) q/k
norms, and its local/global pattern: ``sliding_window_pattern`` - 1 sliding layers then
a global one, the sliding layers rotating with their own (local) rope base."""

from __future__ import annotations

from conveyor.config.kv_window import gemma3_layer_types
from conveyor.model.models.decoder import DecoderForCausalLM, FamilyTraits


class Gemma3ForCausalLM(DecoderForCausalLM):
    traits = FamilyTraits(sliding_window=True, norm_plus_one=True, sandwich_norms=True,
                          embed_scale_sqrt=True, qk_norm=True, local_rope=True)

    @classmethod
    def layer_types(cls, hf: dict, num_layers: int) -> list[str]:
        return gemma3_layer_types(hf, num_layers)


MODEL = Gemma3ForCausalLM
