"""benchmarks/peers' quantized dtypes and decode workloads: what each system is given at
q8_0 and q4_0, which systems are refused and why, and what ``--batch N`` asks for. (The
peers themselves are not run here.)"""

from __future__ import annotations

import pytest

from benchmarks.peers.install import PeerPaths
from benchmarks.peers.quantized import QUANT_DTYPES, unsupported
from benchmarks.peers.run import parse_args
from benchmarks.peers.systems import SYSTEMS, Context, conveyor_server, vllm_server


def _context(tmp_path) -> Context:
    return Context(PeerPaths(str(tmp_path)), "/repo", "/ckpt", 2, {"q8_0": "/ckpt/q8.gguf"},
                   vllm_checkpoints={"q8_0": "/ckpt/w8a8"})


def test_every_system_runs_or_is_refused_with_a_reason():
    runs = {(name, dtype) for name in SYSTEMS for dtype in QUANT_DTYPES
            if unsupported(name, dtype) is None}
    assert runs == {("conveyor", "q8_0"), ("conveyor", "q4_0"), ("llamacpp", "q8_0"),
                    ("llamacpp", "q4_0"), ("vllm", "q8_0")}
    assert "4-bit" in unsupported("vllm", "q4_0")
    assert all(unsupported(name, d) is None for name in SYSTEMS for d in ("bf16", "fp32"))


@pytest.mark.parametrize("dtype,method", [("q8_0", "int8"), ("q4_0", "int4")])
def test_conveyor_quantizes_the_bf16_checkpoint_at_load(dtype, method, tmp_path):
    argv = conveyor_server(_context(tmp_path), dtype, 8000).argv
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert argv[argv.index("--quantization") + 1] == method
    assert "--quantization" not in conveyor_server(_context(tmp_path), "bf16", 8000).argv


def test_vllm_loads_the_w8a8_checkpoint_at_q8_0_only(tmp_path):
    ctx = _context(tmp_path)
    q8 = vllm_server(ctx, "q8_0", 8000).argv
    assert q8[q8.index("--model") + 1] == "/ckpt/w8a8"
    bf16 = vllm_server(ctx, "bf16", 8000).argv
    assert bf16[bf16.index("--model") + 1] == "/ckpt"


def test_batch_is_n_requests_of_fixed_lengths():
    args = parse_args(["--batch", "32", "--dtypes", "q8_0,q4_0"])
    assert (args.num_requests, args.prompt_len, args.output_len) == (32, "128-128",
                                                                     "256-256")
    assert args.dtypes == ["q8_0", "q4_0"]
    assert parse_args(["--batch", "1", "--output-len", "64-64"]).output_len == "64-64"
    with pytest.raises(SystemExit):
        parse_args(["--batch", "4", "--num-requests", "8"])


def test_qwen3_06b_shape_is_the_preset_with_the_shared_vocabulary():
    from benchmarks.peers.shapes import VOCAB, model_shape
    from conveyor.config.presets import preset_config

    cfg = model_shape("qwen3-0.6b").config
    preset = preset_config("qwen3-0.6b")
    assert cfg["vocab_size"] == VOCAB and cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert all(cfg[k] == preset[k] for k in ("hidden_size", "intermediate_size",
                                             "num_hidden_layers", "num_attention_heads",
                                             "num_key_value_heads", "head_dim"))
    args = parse_args(["--model-shapes", "qwen3-0.6b", "--dtypes", "q8_0,q4_0",
                       "--batch", "8"])
    assert args.model_shapes == ["qwen3-0.6b"]
