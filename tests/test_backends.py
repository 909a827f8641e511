"""Attention and linear backends by registry: lookup, the auto choice, errors that name
the registered backends or the reason a forced one does not apply, and a backend
registered from outside (as a GPU backend would be) found and used."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conveyor.kernels import cpu as kernels
from conveyor.model.attention.backend import AttentionBackend
from conveyor.model.attention.native_decode import NativeDecode
from conveyor.model.attention.native_prefill import NativePrefill
from conveyor.model.attention.registry import (
    attention_backends,
    pick_decode_kernel,
    select_attention_backend,
)
from conveyor.model.attention.sdpa import SdpaAttentionBackend, sdpa_decode
from conveyor.model.backend_registry import BackendUnavailableError, Registry
from conveyor.model.dtypes import cpu_has_native_bf16
from conveyor.model.layers.ops import NativeOps
from conveyor.model.linear.backend import LinearBackend
from conveyor.model.linear.native import native_gemm_lib
from conveyor.model.linear.onednn import OneDnnLinearBackend, onednn_available
from conveyor.model.linear.packing import pack_linears, packed_linear
from conveyor.model.linear.registry import (
    linear_backend_choices,
    linear_backends,
    pick_linear_backend,
    select_linear_backend,
)

CPU = torch.device("cpu")
native_attention = kernels.load() is not None


def test_builtin_backends_are_registered_in_priority_order() -> None:
    names = attention_backends.names()
    assert names.index("native") < names.index("sdpa")
    names = linear_backends.names()
    assert names.index("native") < names.index("onednn") < names.index("torch")
    assert attention_backends.get("sdpa") is SdpaAttentionBackend
    assert linear_backends.get("onednn") is OneDnnLinearBackend
    assert ("auto", *linear_backends.names()) == linear_backend_choices()


@pytest.mark.parametrize("lookup", [
    lambda: pick_decode_kernel("fast", CPU, torch.float32, 8, 2),
    lambda: select_attention_backend("fast", CPU, torch.float32, 8, 2),
    lambda: attention_backends.get("fast"),
])
def test_unknown_attention_backend_lists_the_registered_names(lookup) -> None:
    with pytest.raises(ValueError, match="attention_backend must be one of auto, ") as e:
        lookup()
    for name in attention_backends.names():
        assert name in str(e.value)
    assert "'fast'" in str(e.value)


@pytest.mark.parametrize("lookup", [
    lambda: pick_linear_backend("mkl", CPU, torch.float32),
    lambda: packed_linear(torch.ones(2, 2), None, "mkl"),
])
def test_unknown_linear_backend_lists_the_registered_names(lookup) -> None:
    with pytest.raises(ValueError, match="linear_backend must be one of auto, ") as e:
        lookup()
    for name in linear_backends.names():
        assert name in str(e.value)


def test_auto_attention_is_native_where_it_applies_else_sdpa() -> None:
    got = pick_decode_kernel("auto", CPU, torch.float32, 8, 2)
    assert isinstance(got, NativeDecode) if native_attention else got is sdpa_decode
    got = pick_decode_kernel("auto", CPU, torch.bfloat16, 8, 2)
    assert isinstance(got, NativeDecode) if native_attention else got is sdpa_decode
    for device, dtype in ((CPU, torch.float16), (torch.device("cuda"), torch.float32),
                          (torch.device("meta"), torch.float32)):
        assert pick_decode_kernel("auto", device, dtype, 8, 2) is sdpa_decode
    assert pick_decode_kernel("sdpa", CPU, torch.float32, 8, 2) is sdpa_decode


def test_attention_backend_brings_its_prefill_kernel_and_layer_ops() -> None:
    sdpa = select_attention_backend("sdpa", "cpu", torch.float32, 8, 2)
    assert sdpa.prefill_kernel() is None and sdpa.layer_ops() is None
    assert sdpa.decode_kernel().needs_mask
    if not native_attention:
        return
    fp32 = select_attention_backend("native", CPU, torch.float32, 8, 2)
    assert isinstance(fp32.decode_kernel(), NativeDecode) and not fp32.decode_kernel().needs_mask
    assert isinstance(fp32.prefill_kernel(), NativePrefill)
    assert isinstance(fp32.layer_ops(), NativeOps)
    bf16 = select_attention_backend("native", CPU, torch.bfloat16, 8, 2)
    assert isinstance(bf16.prefill_kernel(), NativePrefill)
    assert isinstance(bf16.layer_ops(), NativeOps)
    fp16 = select_attention_backend("sdpa", CPU, torch.float16, 8, 2)
    assert fp16.layer_ops() is None


def test_forced_attention_backend_that_does_not_apply_says_why() -> None:
    with pytest.raises(BackendUnavailableError,
                       match="attention_backend='native': needs a CPU device") as e:
        pick_decode_kernel("native", CPU, torch.float16, 8, 2)
    assert isinstance(e.value, ValueError) and isinstance(e.value, RuntimeError)
    with pytest.raises(ValueError, match="needs a CPU device"):
        pick_decode_kernel("native", torch.device("cuda"), torch.float32, 8, 2)


def test_forced_native_without_the_kernels_names_the_switch(monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_NATIVE_KERNELS", "0")
    monkeypatch.setattr(kernels, "load", lambda: None)
    with pytest.raises(RuntimeError, match="CONVEYOR_NATIVE_KERNELS=0"):
        pick_decode_kernel("native", CPU, torch.float32, 8, 2)
    with pytest.raises(ValueError, match=r"needs a float32 model on a CPU with AVX2.*"
                       r"CONVEYOR_NATIVE_KERNELS=0"):
        pick_linear_backend("native", CPU, torch.float32)
    assert pick_decode_kernel("auto", CPU, torch.float32, 8, 2) is sdpa_decode
    assert pick_linear_backend("auto", CPU, torch.float32) == (
        "onednn" if onednn_available() else "torch")


def test_auto_linears_and_forced_errors() -> None:
    expected = ("native" if native_gemm_lib() is not None
                else "onednn" if onednn_available() else "torch")
    assert pick_linear_backend("auto", CPU, torch.float32) == expected
    assert select_linear_backend("auto", "cpu", torch.float32).name == expected
    bf16_packs = onednn_available() and cpu_has_native_bf16()
    assert pick_linear_backend("auto", CPU, torch.bfloat16) == (
        "onednn" if bf16_packs else "torch")
    assert pick_linear_backend("auto", torch.device("cuda"), torch.float32) == "torch"
    with pytest.raises(BackendUnavailableError, match="linear_backend='onednn': needs a "
                       "float32 model"):
        pick_linear_backend("onednn", CPU, torch.float16)
    with pytest.raises(ValueError, match="needs a float32 model on a CPU with AVX2"):
        pick_linear_backend("native", torch.device("cuda"), torch.float32)
    with pytest.raises(ValueError, match="no packed linear for backend 'torch'"):
        packed_linear(torch.ones(2, 2), None, "torch")


def test_registry_rules() -> None:
    reg: Registry = Registry("toy")

    class A:
        name, priority = "a", 1

        @classmethod
        def supports(cls, flag):
            return None if flag else "wants the flag"

    class B:
        name, priority = "b", 5

        @classmethod
        def supports(cls, flag):
            return "never applies"

    class C:
        name, priority = "c", 1

        @classmethod
        def supports(cls, flag):
            return None

    for cls in (A, B, C):
        reg.register(cls)
    assert reg.names() == ("b", "a", "c")  # priority, then registration order
    assert reg.select("auto", True) is A
    assert reg.select("auto", False) is C
    with pytest.raises(BackendUnavailableError, match="toy_backend='b': never applies"):
        reg.select("b", True)
    with pytest.raises(ValueError, match="already registered"):
        reg.register(A)
    for bad in ("auto", ""):
        with pytest.raises(ValueError, match="name other than 'auto'"):
            reg.register(type("Bad", (), {"name": bad, "priority": 0}))
    assert reg.unregister("c") is C
    with pytest.raises(BackendUnavailableError,
                       match=r"no toy backend applies \(b: never applies; a: wants the flag\)"):
        reg.select("auto", False)
    with pytest.raises(ValueError, match="toy_backend must be one of auto, b or a, got 'c'"):
        reg.unregister("c")


@pytest.fixture
def fake_attention():
    """A backend registered from outside, for float64 models only, at top priority."""
    calls = []

    def decode(q, k_cache, v_cache, meta, scale):
        calls.append(q.shape)
        return sdpa_decode(q, k_cache, v_cache, meta, scale)

    decode.needs_mask = True

    @attention_backends.register
    class FakeBackend(AttentionBackend):
        name, priority = "test-fake", 10_000

        @classmethod
        def supports(cls, device, dtype, num_heads, num_kv_heads, head_dim=None):
            return None if dtype == torch.float64 else "only runs float64 models"

        def decode_kernel(self):
            return decode

    try:
        yield FakeBackend, decode, calls
    finally:
        attention_backends.unregister("test-fake")
    assert "test-fake" not in attention_backends.names()


def test_a_registered_attention_backend_is_found_and_chosen(fake_attention) -> None:
    cls, decode, _ = fake_attention
    assert attention_backends.names()[0] == "test-fake"
    assert pick_decode_kernel("test-fake", CPU, torch.float64, 8, 2) is decode
    assert pick_decode_kernel("auto", CPU, torch.float64, 8, 2) is decode  # top priority
    assert pick_decode_kernel("auto", CPU, torch.float16, 8, 2) is sdpa_decode  # declines
    with pytest.raises(ValueError, match="attention_backend='test-fake': only runs float64"):
        pick_decode_kernel("test-fake", CPU, torch.float32, 8, 2)
    with pytest.raises(ValueError, match="test-fake"):  # listed among the names
        pick_decode_kernel("nope", CPU, torch.float32, 8, 2)
    with pytest.raises(ValueError, match="already registered"):
        attention_backends.register(cls)


def test_the_engine_runs_a_registered_attention_backend(fake_attention) -> None:
    from conveyor import LLM, SamplingParams

    _, _, calls = fake_attention

    @attention_backends.register
    class SdpaCopy(SdpaAttentionBackend):  # the same kernel under another name,
        name = "test-sdpa-copy"  # wrapped to count its calls

        def decode_kernel(self):
            return fake_attention[1]

    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        prompts = [{"prompt_token_ids": [5, 9, 11, 3 + i]} for i in range(2)]
        got = LLM("tiny", load_format="dummy", dtype="float32",
                  attention_backend="test-sdpa-copy").generate(prompts, params)
        want = LLM("tiny", load_format="dummy", dtype="float32",
                   attention_backend="sdpa").generate(prompts, params)
    finally:
        attention_backends.unregister("test-sdpa-copy")
    assert calls  # the decode steps went through the registered kernel
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


class _Doubled(nn.Module):
    def __init__(self, weight, bias) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x):
        return 2 * F.linear(x, self.weight, self.bias)


def test_a_registered_linear_backend_is_found_and_used() -> None:
    @linear_backends.register
    class Doubling(LinearBackend):
        name, priority = "test-doubling", 10_000

        @classmethod
        def supports(cls, device, dtype, weight_dtype=None):
            return None if dtype == torch.float64 else "float64 only"

        def make_linear(self, weight, bias, gate_up=False):
            return _Doubled(weight, bias)

    try:
        assert pick_linear_backend("auto", CPU, torch.float64) == "test-doubling"
        assert pick_linear_backend("auto", CPU, torch.float16) == "torch"
        with pytest.raises(ValueError, match="linear_backend='test-doubling': float64 only"):
            pick_linear_backend("test-doubling", CPU, torch.float32)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3)).double()
        x = torch.randn(2, 4, dtype=torch.float64)
        w0, b0, w1, b1 = (p.detach().clone() for p in model.parameters())
        assert pack_linears(model, "test-doubling") == 2
        assert all(isinstance(m, _Doubled) for m in model)
        torch.testing.assert_close(model(x), 2 * F.linear(2 * F.linear(x, w0, b0), w1, b1))
    finally:
        linear_backends.unregister("test-doubling")
    assert "test-doubling" not in linear_backends.names()
