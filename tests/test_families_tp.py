"""Mixture of experts' checkpoint layouts and tensor parallelism for the newer families:
experts stacked in one tensor load as per-expert ones do, and TP = 2 (two gloo processes)
gives the same greedy tokens as one process and transformers, for a MoE (experts' shards
per rank), Gemma 2 (per-layer windows and soft caps on half the heads) and OLMo 2 (q/k
norms over all heads: each rank's slice, the sums of squares all-reduced, a KV head two
ranks hold counted once)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.config import EngineArgs
from conveyor.engine.llm_engine import LLMEngine

from helpers import hf_greedy, random_prompts
from test_families import FAMILIES, checkpoint

# OLMo 2 with one KV head: both ranks hold it (its norm's sum of squares counted once).
FAMILIES.setdefault("olmo2_one_kv_head", ("Olmo2Config", dict(num_key_value_heads=1)))


@functools.cache
def stacked_copy(family: str) -> str:
    """The checkpoint with each layer's experts stacked (``mlp.experts.gate_up_proj``
    [E, 2 I, H], ``mlp.experts.down_proj`` [E, H, I]), transformers' in-memory layout."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = checkpoint(family)
    with open(os.path.join(src, "config.json")) as f:
        hf = json.load(f)
    experts = hf.get("num_experts") or hf["num_local_experts"]
    with safe_open(os.path.join(src, "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    out: dict[str, torch.Tensor] = {}
    for layer in range(hf["num_hidden_layers"]):
        pre = f"model.layers.{layer}.mlp.experts"
        w = {p: [tensors.pop(f"{pre}.{e}.{p}.weight") for e in range(experts)]
             for p in ("gate_proj", "up_proj", "down_proj")}
        out[f"{pre}.gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(w["gate_proj"], w["up_proj"])])
        out[f"{pre}.down_proj"] = torch.stack(w["down_proj"])
    out.update(tensors)
    path = tempfile.mkdtemp(prefix=f"conveyor-{family}-stacked-")
    for name in os.listdir(src):
        if name != "model.safetensors":
            shutil.copy(os.path.join(src, name), path)
    save_file(out, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def test_stacked_experts_load_as_per_expert_ones() -> None:
    prompts = random_prompts(5, lo=3, hi=40, seed=4)
    params = SamplingParams(max_tokens=6, temperature=0.0)
    outs = {}
    for path in (checkpoint("qwen3_moe"), stacked_copy("qwen3_moe")):
        llm = LLM(path, dtype="float32")
        outs[path] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params)]
    per_expert, stacked = outs.values()
    assert stacked == per_expert
    assert per_expert == [hf_greedy(checkpoint("qwen3_moe"), p, 6) for p in prompts]


def test_a_checkpoint_missing_an_expert_is_refused() -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    src = stacked_copy("qwen3_moe")
    path = tempfile.mkdtemp(prefix="conveyor-moe-missing-")
    for name in os.listdir(src):
        if name != "model.safetensors":
            shutil.copy(os.path.join(src, name), path)
    with safe_open(os.path.join(src, "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()  # noqa: SIM118
                   if k != "model.layers.1.mlp.experts.down_proj"}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks weights.*layers\.1\.mlp\.experts\.0\.down_proj"):
        LLM(path, dtype="float32")


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int]
         ) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request({"prompt_token_ids": p},
                           SamplingParams(max_tokens=max_tokens[i], temperature=0.0),
                           request_id=str(i))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


TP_CASES = {
    "mixtral": lambda: checkpoint("mixtral"),  # per-expert tensors, renormalized top-2
    "qwen3_moe_stacked": lambda: stacked_copy("qwen3_moe"),  # stacked, plain top-3
    "gemma2": lambda: checkpoint("gemma2"),
    "olmo2": lambda: checkpoint("olmo2"),
    "olmo2_one_kv_head": lambda: checkpoint("olmo2_one_kv_head"),
}


@pytest.mark.parametrize("case", list(TP_CASES))
def test_tp2_greedy_equals_one_process_and_transformers(case: str, monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_MEASURE_LINEARS", "0")
    path = TP_CASES[case]()
    prompts = random_prompts(6, lo=2, hi=45, seed=11)
    max_tokens = [3 + (7 * i) % 11 for i in range(len(prompts))]
    kw = dict(model=path, dtype="float32", num_threads=1, warmup=False,
              max_num_batched_tokens=16, num_kv_blocks=12, block_size=8)
    want = _run(LLMEngine(EngineArgs(**kw)), prompts, max_tokens)
    tp = LLMEngine(EngineArgs(tensor_parallel_size=2, **kw))
    try:
        got = _run(tp, prompts, max_tokens)
        info = tp.core.executor.rank_info
    finally:
        tp.shutdown()
    assert got == want
    reference = checkpoint("qwen3_moe") if case == "qwen3_moe_stacked" else path
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == hf_greedy(reference, prompt, max_tokens[i]), f"request {i}"
    assert [r.kv_heads for r in info] == ([[0], [0]] if case == "olmo2_one_kv_head"
                                          else [[0], [1]])
