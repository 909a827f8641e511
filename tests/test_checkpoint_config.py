"""A config.json without ``architectures`` (what ``AutoConfig.for_model(...).save_pretrained()``
writes) falls back on ``model_type``, as transformers' Auto classes do, and says so."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

import pytest

from conveyor import LLM, SamplingParams
from conveyor.config import model_config_from_hf

from helpers import ARCHS, hf_config, hf_greedy, make_checkpoint


def _without_architectures(path: str) -> str:
    copy = tempfile.mkdtemp(prefix="conveyor-noarch-")
    shutil.copytree(path, copy, dirs_exist_ok=True)
    cfg_file = os.path.join(copy, "config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    cfg.pop("architectures", None)
    with open(cfg_file, "w") as f:
        json.dump(cfg, f)
    return copy


def test_auto_config_for_model_writes_no_architectures() -> None:
    """The premise: transformers' own writer leaves the field out."""
    import transformers as tf

    path = tempfile.mkdtemp(prefix="conveyor-autocfg-")
    tf.AutoConfig.for_model("qwen2", hidden_size=64).save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        assert not json.load(f).get("architectures")


@pytest.mark.parametrize("arch", ARCHS)
def test_model_type_picks_the_architecture_and_outputs_stay_exact(arch: str, caplog) -> None:
    path = _without_architectures(make_checkpoint(arch))
    with caplog.at_level(logging.WARNING, logger="conveyor.config"):
        llm = LLM(path, dtype="float32")
    chosen = llm.engine.config.model.architecture
    assert chosen.lower().startswith(arch)
    assert any(chosen in r.getMessage() and "model_type" in r.getMessage()
               for r in caplog.records)
    prompt = [5, 17, 33, 9, 100]
    got = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0].token_ids
    assert got == hf_greedy(make_checkpoint(arch), prompt, 8)


def test_an_unknown_model_type_is_a_clear_error() -> None:
    hf = hf_config("llama").to_dict()
    hf.pop("architectures", None)
    hf["model_type"] = "gpt2"
    with pytest.raises(ValueError, match=r"model_type 'gpt2'.*supported.*llama, mistral"):
        model_config_from_hf(hf, "x")
    hf["architectures"] = ["GPT2LMHeadModel"]  # named but unsupported: no fallback
    hf["model_type"] = "llama"
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        model_config_from_hf(hf, "x")
