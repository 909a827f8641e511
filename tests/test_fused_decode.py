"""Small decode-only steps as one native call (runner/fused_decode.py, decode_forward.c):
greedy ids equal transformers' (float32) and the dequantised model's (int8 / int4) under
batching, chunked prefills, preemption and prefix hits; every logit and every K/V row
equal the modules' own; the path runs where it applies and stays off elsewhere."""

from __future__ import annotations

import copy

import pytest
import torch
from test_exactness import check_exact
from test_quantization import _check as check_quantized

from conveyor import LLM, SamplingParams
from conveyor.kernels import cpu as kernels
from conveyor.kernels.cpu.quant import PackedQGemm
from conveyor.runner import fused_decode

from helpers import make_checkpoint, random_prompts

pytestmark = pytest.mark.skipif(
    kernels.load() is None or not kernels.load().gemm_f32_available(),
    reason="the native GEMM is not built on this machine")

NATIVE = dict(linear_backend="native", attention_backend="native")
CONFIGS = {
    "default": dict(),
    "chunked": dict(max_num_batched_tokens=13),  # prefill chunks beside decode rows
    "preempt": dict(num_kv_blocks=9, block_size=8),
}


def _fused_steps(llm) -> int:
    fused = llm.engine.runner.fused_decode
    assert fused is not None, "the fused decode path is off for this model"
    return fused.num_steps


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_equals_transformers(arch: str, config: str) -> None:
    path = make_checkpoint(arch)
    llm = LLM(path, dtype="float32", **NATIVE, **CONFIGS[config])
    prompts = random_prompts(10, seed=1)
    params = [SamplingParams(max_tokens=3 + i % 7, temperature=0.0) for i in range(10)]
    # twice: the second pass hits the prefix cache
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        check_exact(path, outs, prompts, params)
    assert _fused_steps(llm) > 0


@pytest.fixture
def native_int(monkeypatch):
    """The quantized linears on quant_gemm.c whatever start-up measures."""
    from conveyor.kernels.cpu import quant

    if not quant.simd():
        pytest.skip("no AVX2 build of the quantized kernel")
    monkeypatch.setenv("CONVEYOR_QUANT_LINEAR", "native-int")


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_greedy_equals_dequantised_model(method: str, native_int) -> None:
    llm = LLM(make_checkpoint("llama"), dtype="float32", quantization=method,
              attention_backend="native", max_num_batched_tokens=13)
    check_quantized(llm, "llama", method=method)
    assert _fused_steps(llm) > 0


def _logits_and_kv(path: str, fused: bool, change_model=None, **kw):
    """Each step's logits of a batch of greedy requests, and the K/V pool after them
    (``change_model``: applied to the loaded model before the fused path is built)."""
    llm = LLM(path, dtype="float32", enable_prefix_caching=False, max_num_seqs=3,
              **{"attention_backend": "native", **kw})
    runner = llm.engine.runner
    if change_model is not None:
        change_model(runner.model)
        runner._build_fused_decode()
    if not fused:
        runner.fused_decode = None
    runner.record_logits = True
    for i, p in enumerate(random_prompts(3, seed=2, lo=5, hi=30)):
        llm.engine.add_request({"prompt_token_ids": p},
                               SamplingParams(max_tokens=6 + 2 * i, temperature=0.0,
                                              ignore_eos=True), request_id=str(i))
    steps = []
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        steps.append(dict(runner.last_logits))
    return llm, steps, runner.kv_caches


def _assert_same(got, want, got_kv=None, want_kv=None) -> None:
    """Every step's logits, and the K/V pools where given, equal bit for bit."""
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys()
        for rid in g:
            assert torch.equal(g[rid], w[rid]), (step, rid)
    for (gk, gv), (wk, wv) in zip(got_kv or [], want_kv or [], strict=True):
        assert torch.equal(gk, wk) and torch.equal(gv, wv)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # QKV bias; per-head q/k norms
@pytest.mark.parametrize("kw", [dict(NATIVE), dict(quantization="int8"),
                                dict(quantization="int4")], ids=["float32", "int8", "int4"])
def test_same_logits_and_kv_as_the_modules(kw: dict, arch: str, native_int) -> None:
    """Bit for bit: any layer's step done otherwise than the modules do shows here."""
    path = make_checkpoint(arch)
    fast, got, got_kv = _logits_and_kv(path, True, **kw)
    _, want, want_kv = _logits_and_kv(path, False, **kw)
    assert _fused_steps(fast) >= 5
    _assert_same(got, want, got_kv, want_kv)


@pytest.mark.parametrize("bits", [4, 8])
def test_a16_linears_same_logits_and_kv_as_the_modules(bits: int, monkeypatch) -> None:
    """qgemm_a16's int4 and qgemm_a16_i8's int8 linears (x rounded to int16; int8's int32
    sums in 512-column blocks) run in the C forward as the modules run them, bit for bit,
    every projection on them and the fused path on (a wrong kind, layout, argument order
    or missing zero term shows in the logits). The int8 LM head is on qgemm_f32."""
    from conveyor.kernels.cpu import quant

    if not quant.simd():
        pytest.skip("no AVX2 build of the quantized kernel")
    from conveyor.model.quant import apply

    monkeypatch.setattr(apply, "candidates", lambda scheme, *_: [
        f"native-int{bits}-a16" if scheme.bits == bits else "native-int"])
    path = make_checkpoint("qwen3")
    fast, got, got_kv = _logits_and_kv(path, True, quantization=f"int{bits}")
    _, want, want_kv = _logits_and_kv(path, False, quantization=f"int{bits}")
    from conveyor.model.quant.linear import NativeA16Linear
    for layer in fast.engine.runner.model.layers:
        for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                    layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert type(mod) is NativeA16Linear and mod.bits == bits
    assert _fused_steps(fast) >= 5
    _assert_same(got, want, got_kv, want_kv)


def test_row_range_linears_run_the_backend_of_the_steps_rows(native_int) -> None:
    """A linear split by row range (the start-up choice per row range) runs here the
    backend its range gives the step's rows, as the module does: every step's logits
    equal the modules' with the down projections' few-rows weight scaled, steps of three
    rows (past the range) run here too."""
    from conveyor.model.quant.linear import RowRangeLinear

    def split_down_projections(model) -> None:
        for layer in model.layers:
            many = layer.mlp.down_proj
            few = copy.copy(many)  # a second module over the weight scaled by 2: which
            qw, scales, zeros, bias = many.gemm._keep  # one ran shows in the logits
            few.gemm = PackedQGemm(qw, many.bits, scales * 2, zeros, many.group, bias,
                                   many.out_features, many.in_features)
            layer.mlp.down_proj = RowRangeLinear(few, many, max_rows=2)

    path = make_checkpoint("llama")
    fast, got, _ = _logits_and_kv(path, True, split_down_projections, quantization="int8")
    _, want, _ = _logits_and_kv(path, False, split_down_projections, quantization="int8")
    assert fast.engine.runner.fused_decode.max_rows == fused_decode.MAX_ROWS
    assert _fused_steps(fast) == len(got) - 1  # every step but the prompts' (3, 2, 1 rows)
    assert [len(step) for step in got].count(3) > 1
    _assert_same(got, want)


class _Doubled(torch.nn.Module):
    """Another backend's numbers for a projection: twice ``inner``'s."""

    applies_silu_mul = False

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner, self.in_features, self.out_features = \
            inner, inner.in_features, inner.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.inner(x)


def test_float_row_split_linears_run_their_few_rows_backend() -> None:
    """A float projection split by rows (``linear/few_rows.py``: conveyor's GEMM for few
    rows, another backend past them) runs its GEMM here, the path capped at its rows."""
    from conveyor.model.linear.few_rows import RowSplitLinear

    def split_o_projections(model) -> None:
        for layer in model.layers:
            few = layer.self_attn.o_proj
            layer.self_attn.o_proj = RowSplitLinear(few, _Doubled(few), max_rows=2)

    path = make_checkpoint("qwen2")
    fast, got, _ = _logits_and_kv(path, True, split_o_projections, **NATIVE)
    _, want, _ = _logits_and_kv(path, False, split_o_projections, **NATIVE)
    assert fast.engine.runner.fused_decode.max_rows == 2
    assert _fused_steps(fast) >= 3
    _assert_same(got, want)


def test_rows_past_the_limit_take_the_modules(monkeypatch) -> None:
    monkeypatch.setattr(fused_decode, "MAX_ROWS", 2)
    llm = LLM(make_checkpoint("llama"), dtype="float32", max_num_seqs=3, **NATIVE)
    fused = llm.engine.runner.fused_decode
    assert fused.max_rows == 2
    calls = []
    real = type(fused).__call__
    monkeypatch.setattr(type(fused), "__call__",
                        lambda self, h, *a: calls.append(h.shape[0]) or real(self, h, *a))
    llm.generate([{"prompt_token_ids": p} for p in random_prompts(3, seed=3)],
                 [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
                  for n in (3, 6, 9)])
    # steps of 3 decode rows took the modules, those of 1 or 2 the fused path
    assert calls and max(calls) <= 2


def test_off_where_it_does_not_apply(monkeypatch) -> None:
    from test_families import checkpoint

    # Gemma 2's sandwich norms, soft-capping and per-layer windows are not in the C code
    assert LLM(checkpoint("gemma2"), dtype="float32",
               **NATIVE).engine.runner.fused_decode is None
    # the torch linears are not native ones
    assert LLM(make_checkpoint("llama"), dtype="float32", linear_backend="torch",
               attention_backend="native").engine.runner.fused_decode is None
    monkeypatch.setenv("CONVEYOR_FUSED_DECODE", "0")
    assert LLM(make_checkpoint("llama"), dtype="float32",
               **NATIVE).engine.runner.fused_decode is None
