"""Mixtral: Llama's attention (a sliding window where config.json sets one) with a sparse
mixture-of-experts block in every layer (``layers/moe.py``): top-k routing, the top-k
weights renormalized to sum to 1."""

from __future__ import annotations

from torch import nn

from conveyor.model.layers.moe import moe_block
from conveyor.model.models.decoder import DecoderForCausalLM, FamilyTraits


class MixtralForCausalLM(DecoderForCausalLM):
    traits = FamilyTraits(sliding_window=True)

    def make_mlp(self, layer: int) -> nn.Module | None:
        return moe_block({**self.cfg.hf_config, "norm_topk_prob": True,
                          "moe_intermediate_size": None},
                         self.cfg.hidden_size, self.tp, float32_weights=True)


MODEL = MixtralForCausalLM
