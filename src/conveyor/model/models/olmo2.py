"""OLMo 2: norms after attention and after the MLP only (no pre-norms), and RMS norms of
the whole q and k rows (all heads at once) before the rotation."""

from __future__ import annotations

from conveyor.model.models.decoder import DecoderForCausalLM, FamilyTraits


class Olmo2ForCausalLM(DecoderForCausalLM):
    traits = FamilyTraits(post_norms_only=True, qk_norm_full=True)


MODEL = Olmo2ForCausalLM
