"""Llama (1-3.x): the shared decoder as it is."""

from __future__ import annotations

from conveyor.model.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    pass


MODEL = LlamaForCausalLM
