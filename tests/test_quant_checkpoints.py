"""Pre-quantized checkpoints (compressed-tensors, written by its own library): greedy ids
equal transformers' on the dequantised float32 model, for every scheme, under batching,
chunked prefill, preemption, each quantized kernel and tensor parallelism (TP = 2)."""

from __future__ import annotations

import functools
import json
import shutil

import pytest

from conveyor import LLM, SamplingParams

from helpers import hf_greedy, make_checkpoint, random_prompts

ct = pytest.importorskip("compressed_tensors")

from ct_checkpoints import SCHEMES, write_checkpoint  # noqa: E402
from quant_helpers import dequantised_copy, int8_dequant  # noqa: E402


@functools.cache
def _reference(ref: str, prompt: tuple[int, ...], n: int) -> list[int]:
    return hf_greedy(ref, list(prompt), n)


def _check(llm, ref: str, seed: int = 0, n: int = 8) -> None:
    prompts = random_prompts(n, lo=2, hi=50, seed=seed)
    params = [SamplingParams(max_tokens=4 + i % 9, temperature=0.0) for i in range(n)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for i, (out, p, sp) in enumerate(zip(outs, prompts, params)):
        assert out.outputs[0].token_ids == _reference(ref, tuple(p), sp.max_tokens), \
            f"request {i}"


def _quantized_modules(llm) -> set[str]:
    return {type(m).__name__ for m in llm.engine.runner.model.layers.modules()
            if "QuantLinear" in type(m).__mro__[1].__name__}


# W8A8: a row's int8 activations come from its float values by rounding, so a rounding
# error in the hidden state (float sums in the reference, exact integer sums here) can
# flip one activation's rounding and move a logit. Stated bound: a request may leave the
# reference's greedy path only where the reference itself nearly ties, the token taken
# within W8A8_TIE of its best logit (tiny random models have such near-ties).
W8A8_TIE = 0.02


def _check_w8a8(llm, ref: str, n: int = 8) -> None:
    import torch

    from helpers import hf_model

    prompts = random_prompts(n, lo=2, hi=50, seed=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(max_tokens=10, temperature=0.0)] * n)
    left = 0
    for out, p in zip(outs, prompts):
        got, want = out.outputs[0].token_ids, _reference(ref, tuple(p), 10)
        if got == want:
            continue
        left += 1
        i = next(j for j in range(len(want)) if got[j] != want[j])
        with torch.no_grad():
            logits = hf_model(ref)(torch.tensor([p + want[:i]])).logits[0, -1]
        assert logits.max() - logits[got[i]] <= W8A8_TIE, (p, i)
    assert left <= n // 4


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_compressed_tensors_greedy_matches_dequantised(scheme):
    path, ref = write_checkpoint(scheme)
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors"
    llm = LLM(path, dtype="float32", max_num_batched_tokens=13, num_kv_blocks=10,
              block_size=8)
    if SCHEMES[scheme][1] is not None:  # quantized activations
        _check_w8a8(llm, ref)
        assert llm.stats()["num_preemptions"] > 0
        assert _quantized_modules(llm) == {"W8A8Linear"}
        return
    _check(llm, ref)
    assert _quantized_modules(llm), "the projections should run quantized"
    assert llm.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("backend", ["native-int", "dequant"])
@pytest.mark.parametrize("scheme", ["w8a16", "w4a16-asym-g16", "w4a16-sym-g16"])
def test_compressed_tensors_each_kernel(scheme, backend, monkeypatch):
    from conveyor.kernels.cpu import quant

    if backend == "native-int" and not quant.simd():
        pytest.skip("no AVX2 build of the quantized kernel")
    monkeypatch.setenv("CONVEYOR_QUANT_LINEAR", backend)
    path, ref = write_checkpoint(scheme)
    llm = LLM(path, dtype="float32")
    _check(llm, ref, seed=5, n=5)
    kinds = _quantized_modules(llm)
    assert kinds == {"NativeQuantLinear" if backend == "native-int" else "DequantLinear"}


@pytest.mark.parametrize("case", ["w8a16", "w4a16-asym-channel", "int8"])
def test_tp2_quantized_greedy_matches_dequantised(case, monkeypatch):
    monkeypatch.setenv("CONVEYOR_MEASURE_LINEARS", "0")
    if case == "int8":  # on the fly: a row split over ranks takes the whole row's scale
        path = make_checkpoint("llama")
        ref = dequantised_copy(path, int8_dequant, head=True)
        kw = dict(quantization="int8")
    else:
        path, ref = write_checkpoint(case)
        kw = {}
    llm = LLM(path, dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=13, **kw)
    try:
        _check(llm, ref, seed=7, n=6)
    finally:
        llm.engine.shutdown()


def test_unsupported_compressed_tensors_schemes_are_refused(tmp_path):
    path, _ = write_checkpoint("w8a16")
    for change, match in [
        (lambda g: g.update(input_activations={"num_bits": 8, "type": "int",
                                               "strategy": "tensor", "dynamic": False}),
         "input activations"),
        (lambda g: g["weights"].update(type="float"), "float 8-bit"),
        (lambda g: g.update(format="nvfp4-pack-quantized"), "nvfp4"),
    ]:
        dst = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        shutil.copytree(path, dst)
        cfg = json.loads((dst / "config.json").read_text())
        change(cfg["quantization_config"]["config_groups"]["group_0"])
        (dst / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=match):
            LLM(str(dst), dtype="float32")


@pytest.mark.parametrize("method,act_order", [("gptq", False), ("gptq", True),
                                              ("awq", False)])
@pytest.mark.parametrize("backend", ["native-int", "dequant"])
def test_gptq_awq_greedy_matches_dequantised(method, act_order, backend, monkeypatch):
    from gptq_awq_checkpoints import write_checkpoint as write_packed

    from conveyor.kernels.cpu import quant

    if backend == "native-int" and not quant.simd():
        pytest.skip("no AVX2 build of the quantized kernel")
    monkeypatch.setenv("CONVEYOR_QUANT_LINEAR", backend)
    path, ref = write_packed(method, act_order)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=13)
    _check(llm, ref, seed=2, n=6)
    assert _quantized_modules(llm)
