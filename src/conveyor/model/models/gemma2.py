"""Gemma 2: (1 + w) RMS norms before and after both sublayers, GeGLU (gelu-tanh) MLP,
embeddings times sqrt(hidden), attention scaled by ``query_pre_attn_scalar`` and its
logits soft-capped (``attn_logit_softcapping``: in the native kernels, else
``attention/softcap.py``; see ``attention/paged.py``),
final logits soft-capped, and a sliding window on alternating layers (even ones)."""

from __future__ import annotations

from conveyor.config.kv_window import gemma2_layer_types
from conveyor.model.models.decoder import DecoderForCausalLM, FamilyTraits


class Gemma2ForCausalLM(DecoderForCausalLM):
    traits = FamilyTraits(sliding_window=True, norm_plus_one=True, sandwich_norms=True,
                          embed_scale_sqrt=True)

    @classmethod
    def layer_types(cls, hf: dict, num_layers: int) -> list[str]:
        return gemma2_layer_types(hf, num_layers)


MODEL = Gemma2ForCausalLM
