"""Granite: Llama's decoder with config.json's multipliers: embeddings times
``embedding_multiplier``, attention scaled by ``attention_multiplier`` (not
1/sqrt(head_dim)), each sublayer's output times ``residual_multiplier``, logits divided by
``logits_scaling`` (all read by the shared decoder where config.json has them)."""

from __future__ import annotations

from conveyor.model.models.decoder import DecoderForCausalLM


class GraniteForCausalLM(DecoderForCausalLM):
    pass


MODEL = GraniteForCausalLM
