"""Gemma 3 (text): Gemma 2's decoder without soft-capping, with per-head (1 + w) q/k
norms, and its local/global pattern: ``sliding_window_pattern`` - 1 sliding layers then
a global one, the sliding layers rotating with their own (local) rope base."""

from __future__ import annotations

from conveyor.model.models.decoder import DecoderForCausalLM, FamilyTraits


class Gemma3ForCausalLM(DecoderForCausalLM):
    traits = FamilyTraits(sliding_window=True, norm_plus_one=True, sandwich_norms=True,
                          embed_scale_sqrt=True, qk_norm=True, local_rope=True)

    @classmethod
    def layer_types(cls, hf: dict, num_layers: int) -> list[str]:
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern")
                      or 6)
        return hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)]


MODEL = Gemma3ForCausalLM
