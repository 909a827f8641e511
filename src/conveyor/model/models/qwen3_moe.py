"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with a sparse mixture-of-experts
block in every layer (``layers/moe.py``): top-k routing, the top-k weights renormalized
only where config.json's ``norm_topk_prob`` says so."""

from __future__ import annotations

from torch import nn

from conveyor.model.layers.moe import moe_block
from conveyor.model.models.decoder import DecoderForCausalLM, FamilyTraits


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    traits = FamilyTraits(qk_norm=True)

    def make_mlp(self, layer: int) -> nn.Module | None:
        return moe_block({"norm_topk_prob": False, **self.cfg.hf_config},
                         self.cfg.hidden_size, self.tp)


MODEL = Qwen3MoeForCausalLM
