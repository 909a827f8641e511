"""Roofline arithmetic on hand-computed cases, parameter counts, hardware specs."""

from __future__ import annotations

import dataclasses
import json

import pytest

from conveyor.config import CacheConfig, EngineArgs, kv_blocks_for, model_config_from_hf
from conveyor.costs.factory import make_cost_model
from conveyor.costs.hardware import HARDWARE_PRESETS, HardwareSpec, load_hardware
from conveyor.costs.roofline import ModelShape, RooflineCostModel
from conveyor.costs.shape import BatchShape
from conveyor.sim import resolve_sim_model

# A toy model whose costs are easy to count by hand (bf16: 2 bytes per value):
#   per layer: q 8x8 + k,v 8x4 each + o 8x8 + gate,up,down 3 x 8x16 = 576 matmul weights,
#              2 norms of 8 = 16 other weights
#   embedding 32x8 = 256, untied LM head 256, final norm 8
#   total 2 * (576 + 16) + 256 + 256 + 8 = 1704 parameters = 3408 bytes
#   KV per token: 2 (K,V) * 2 layers * 1 head * 4 dims * 2 bytes = 32 bytes
TOY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 8,
       "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
       "num_key_value_heads": 1, "head_dim": 4, "max_position_embeddings": 128,
       "torch_dtype": "bfloat16", "tie_word_embeddings": False, "eos_token_id": 2}

# 1e6 FLOP/s and 1e6 B/s peaks at 50% efficiency: 5e5 effective each; 1 ms per step;
# an interconnect of 1e6 B/s per direction with 10 us per all-reduce; 8192 bytes of
# memory of which half is usable.
TOY_HW = HardwareSpec("toy", peak_tflops=1e-6, memory_bandwidth_gbps=1e-3,
                      memory_gib=8192 / 2**30, step_overhead_ms=1.0,
                      compute_efficiency=0.5, memory_efficiency=0.5, memory_utilization=0.5,
                      interconnect_gbps=1e-3, allreduce_latency_us=10.0)


def toy_model():
    return model_config_from_hf(TOY, "toy")


def test_toy_shape_counts():
    shape = ModelShape.from_config(toy_model())
    assert shape.layer_matmul_params == 576
    assert shape.num_params == 1704
    assert shape.weight_bytes == 3408
    assert shape.kv_bytes_per_token() == 32 == toy_model().kv_bytes_per_token
    assert shape.kv_bytes_per_token(tp=2) == 32  # one KV head: replicated, not split


def test_decode_step_by_hand():
    # Two decodes at contexts 10 and 20 (30 KV tokens read), both sampling.
    #   FLOPs = 2*2*576*2 (linear) + 2*8*32*2 (LM head) + 4*2*2*4*30 (attention) = 7552
    #   bytes = (3408 - 512 of untied embedding) + 2 rows * 16 + 32 * (30 + 2) = 3952
    cost = RooflineCostModel(toy_model(), TOY_HW).cost(
        BatchShape(num_decodes=2, decode_context=30, num_sampled=2))
    assert cost.flops == 7552
    assert cost.bytes_per_device == 3952
    assert cost.compute_s == pytest.approx(7552 / 5e5)
    assert cost.memory_s == pytest.approx(3952 / 5e5)
    assert cost.bound == "compute"
    assert cost.total_s == pytest.approx(7552 / 5e5 + 1e-3)


def test_prefill_chunk_by_hand():
    # A chunk of 6 tokens after 4 computed: 6*4 + 6*7/2 = 45 query-key pairs, 10 KV tokens.
    #   FLOPs = 2*2*576*6 + 2*8*32*1 + 4*2*2*4*45 = 13824 + 512 + 2880 = 17216
    #   bytes = 2896 + 6*16 + 32*(10 + 6) = 3504
    shape = BatchShape(num_prefill_tokens=6, num_prefills=1, prefill_attention=45,
                       prefill_context=10, num_sampled=1)
    model = RooflineCostModel(toy_model(), TOY_HW)
    cost = model.cost(shape)
    assert (cost.flops, cost.bytes_per_device) == (17216, 3504)
    assert model.step_time(shape) == pytest.approx(17216 / 5e5 + 1e-3)


def test_memory_bound_when_bandwidth_is_scarce():
    hw = dataclasses.replace(TOY_HW, memory_bandwidth_gbps=1e-5)  # 1e4 B/s -> 5e3 effective
    shape = BatchShape(num_decodes=2, decode_context=30, num_sampled=2)
    model = RooflineCostModel(toy_model(), hw)
    assert model.cost(shape).bound == "memory"
    assert model.step_time(shape) == pytest.approx(3952 / 5e3 + 1e-3)


def test_tensor_parallel_divides_work_and_adds_all_reduces():
    # tp=2: compute 7552 / (2 * 5e5); per device 2896/2 weights + 2*16/2 embedding rows
    # + 32*32 KV (the single KV head is replicated) = 2488 bytes; all-reduce per layer
    # twice: 10 us + 2*(1/2) * 2 tokens * 8 * 2 bytes / 1e6 B/s = 42 us.
    shape = BatchShape(num_decodes=2, decode_context=30, num_sampled=2)
    cost = RooflineCostModel(toy_model(), TOY_HW, tp=2).cost(shape)
    assert cost.compute_s == pytest.approx(7552 / 1e6)
    assert cost.bytes_per_device == pytest.approx(1448 + 16 + 1024)
    assert cost.comm_s == pytest.approx(2 * 2 * 42e-6)
    assert cost.total_s == pytest.approx(7552 / 1e6 + 4 * 42e-6 + 1e-3)
    assert RooflineCostModel(toy_model(), TOY_HW, tp=2).step_time(shape) == \
        pytest.approx(cost.total_s)


def test_kv_pool_is_what_memory_leaves_after_the_weights():
    # tp=1: 8192 * 0.5 - 3408 = 688 bytes -> 21 tokens of 32 bytes -> 672 logical bytes.
    assert RooflineCostModel(toy_model(), TOY_HW).kv_cache_memory(toy_model()) == 672
    # tp=2: 4096 - 1704 = 2392 bytes per device -> 74 tokens (KV replicated) -> 2368.
    assert RooflineCostModel(toy_model(), TOY_HW, tp=2).kv_cache_memory(toy_model()) == 2368
    # The engine's sizing rule turns that into blocks: 672 // (32 * 4) = 5 blocks of 4.
    cost = RooflineCostModel(toy_model(), TOY_HW)
    blocks = kv_blocks_for(CacheConfig(block_size=4), toy_model(), 8,
                           default_memory=lambda: cost.kv_cache_memory(toy_model()),
                           cap_to_useful=cost.cap_kv_to_useful)
    assert blocks == 5


def test_weights_that_do_not_fit_name_the_problem():
    hw = dataclasses.replace(TOY_HW, memory_gib=4096 / 2**30)
    with pytest.raises(ValueError, match="do not fit"):
        RooflineCostModel(toy_model(), hw).kv_cache_memory(toy_model())


def test_tp_needs_an_interconnect():
    with pytest.raises(ValueError, match="interconnect"):
        RooflineCostModel(toy_model(), dataclasses.replace(TOY_HW, interconnect_gbps=0.0),
                          tp=2)


def test_llama3_8b_has_its_published_parameter_count():
    model = resolve_sim_model(EngineArgs(model="llama3-8b"))
    assert ModelShape.from_config(model).num_params == 8_030_261_248
    # On an H100 its ~15 GiB of bf16 weights leave tens of GiB for KV.
    kv = make_cost_model("roofline", model, hardware="h100").kv_cache_memory(model)
    assert 50 * 2**30 < kv < 60 * 2**30


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_parameter_count_matches_transformers(arch):
    import torch

    from helpers import hf_config

    cfg = hf_config(arch)
    with torch.device("meta"):
        import transformers

        hf_model = transformers.AutoModelForCausalLM.from_config(cfg)
    expected = sum(p.numel() for p in hf_model.parameters())
    d = cfg.to_dict()
    d["architectures"] = [type(hf_model).__name__]
    assert ModelShape.from_config(model_config_from_hf(d, arch)).num_params == expected


def test_hardware_presets_and_files(tmp_path):
    assert set(HARDWARE_PRESETS) == {"a100", "h100", "h200", "cpu"}
    assert load_hardware("h200").memory_bandwidth_gbps > load_hardware("h100") \
        .memory_bandwidth_gbps
    path = tmp_path / "mine.json"
    fields = dataclasses.asdict(load_hardware("a100"))
    del fields["name"]
    path.write_text(json.dumps({**fields, "peak_tflops": 400.0}))
    spec = load_hardware(str(path))
    assert spec.name == "mine" and spec.peak_tflops == 400.0
    assert spec.memory_gib == HARDWARE_PRESETS["a100"].memory_gib


@pytest.mark.parametrize("content, message", [
    ({"peak_tflops": 1, "memory_bandwidth_gbps": 1, "memory_gib": 1, "step_overhead_ms": 0,
      "flops": 3}, "unknown field"),
    ({"peak_tflops": 1, "memory_gib": 1, "step_overhead_ms": 0}, "missing field"),
    ({"peak_tflops": 1, "memory_bandwidth_gbps": 1, "memory_gib": 1, "step_overhead_ms": 0,
      "compute_efficiency": 1.5}, "compute_efficiency"),
    ([1, 2], "JSON object"),
])
def test_bad_hardware_files_say_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=message):
        load_hardware(str(path))


def test_unknown_hardware_and_cost_names():
    with pytest.raises(ValueError, match="a100, h100, h200, cpu"):
        load_hardware("tpu")
    with pytest.raises(ValueError, match="roofline"):
        make_cost_model("guess", toy_model())


@pytest.mark.parametrize("arch", ["MixtralConfig", "Qwen3MoeConfig"])
def test_moe_parameter_count_matches_transformers_and_costs_active_ones(arch):
    """Every expert counts in the weights (the KV pool's room); a token's FLOPs count its
    k experts; a step reads the experts its tokens touch, k at one token, all E soon."""
    import torch
    import transformers

    experts = ({"num_local_experts": 8} if arch == "MixtralConfig"
               else {"num_experts": 8, "moe_intermediate_size": 48})
    cfg = getattr(transformers, arch)(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts_per_tok=2,
        **experts)
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(cfg)
    d = cfg.to_dict()
    d["architectures"] = [type(hf_model).__name__]
    model = model_config_from_hf(d, "moe")
    shape = ModelShape.from_config(model)
    assert shape.num_params == sum(p.numel() for p in hf_model.parameters())
    dense_mlp = 3 * 64 * shape.expert_intermediate
    assert shape.layer_matmul_params - shape.active_layer_matmul_params == 6 * dense_mlp
    assert shape.experts_touched(1) == pytest.approx(2.0)
    assert shape.experts_touched(200) == pytest.approx(8.0)
    cost = RooflineCostModel(model, TOY_HW)
    one, many = (cost.cost(BatchShape(num_decodes=n, num_sampled=n, decode_context=n))
                 for n in (1, 200))
    expert_bytes = 2 * dense_mlp * 4  # two layers, float32
    assert many.bytes_per_device - one.bytes_per_device == pytest.approx(
        6 * expert_bytes + 199 * (64 * 4 + model.kv_bytes_per_token * 2), rel=1e-9)


@pytest.mark.parametrize("family", ["phi3", "granite", "olmo2", "gemma2", "gemma3"])
def test_newer_families_parameter_count_matches_transformers(family):
    import torch
    import transformers

    from test_families import _BASE, FAMILIES

    cls_name, overrides = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**{**_BASE, **overrides})
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(cfg)
    d = cfg.to_dict()
    d["architectures"] = [type(hf_model).__name__]
    assert ModelShape.from_config(model_config_from_hf(d, family)).num_params == sum(
        p.numel() for p in hf_model.parameters())
