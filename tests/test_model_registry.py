"""The model families by registry: every architecture config.json may name has a family
module, an unknown one is refused with the supported list, a family's differences from
Llama are its traits, and the kernels package stays below the model layer."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

from conveyor.config import SUPPORTED_ARCHITECTURES
from conveyor.model.models.decoder import DecoderForCausalLM, FamilyTraits
from conveyor.model.models.registry import FAMILIES, model_class


def test_every_supported_architecture_has_a_family() -> None:
    assert tuple(FAMILIES) == SUPPORTED_ARCHITECTURES
    for arch in FAMILIES:
        cls = model_class(arch)
        assert issubclass(cls, DecoderForCausalLM) and cls.__name__ == arch


def test_an_unknown_architecture_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="unsupported architecture") as e:
        model_class("GPT2LMHeadModel")
    for arch in FAMILIES:
        assert arch in str(e.value)


def test_families_differ_by_traits_only() -> None:
    assert model_class("LlamaForCausalLM").traits == FamilyTraits()
    assert model_class("MistralForCausalLM").traits == FamilyTraits(sliding_window=True)
    assert model_class("Qwen2ForCausalLM").traits == FamilyTraits(qkv_bias=True)
    assert model_class("Qwen3ForCausalLM").traits == FamilyTraits(qk_norm=True)
    assert model_class("Phi3ForCausalLM").traits == FamilyTraits(sliding_window=True)
    assert model_class("GraniteForCausalLM").traits == FamilyTraits()  # config multipliers
    assert model_class("Olmo2ForCausalLM").traits == FamilyTraits(post_norms_only=True,
                                                                  qk_norm_full=True)
    gemma2 = FamilyTraits(sliding_window=True, norm_plus_one=True, sandwich_norms=True,
                          embed_scale_sqrt=True)
    assert model_class("Gemma2ForCausalLM").traits == gemma2
    assert model_class("Gemma3ForCausalLM").traits == dataclasses.replace(
        gemma2, qk_norm=True, local_rope=True)
    # Mixtures of experts: their attention's traits, a sparse block from make_mlp.
    assert model_class("MixtralForCausalLM").traits == FamilyTraits(sliding_window=True)
    assert model_class("Qwen3MoeForCausalLM").traits == FamilyTraits(qk_norm=True)


def test_the_kernels_package_does_not_import_the_model_layer() -> None:
    root = pathlib.Path(__file__).parent.parent / "src" / "conveyor" / "kernels"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("conveyor.model") for n in names), path
