"""oneDNN pre-packed linears: the same products as F.linear, the LM head included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conveyor.model.packed_linear import (
    PackedLinear,
    onednn_available,
    pack_linears,
    use_packed_linears,
)

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    x = torch.randn(rows, 40, generator=gen)
    torch.testing.assert_close(PackedLinear(w, b)(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@needs_onednn
def test_pack_linears_replaces_every_linear_and_keeps_the_function() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Sequential(nn.Linear(16, 4)))
    x = torch.randn(5, 8)
    want = model(x)
    assert pack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    torch.testing.assert_close(model(x), want, atol=1e-6, rtol=1e-5)


def test_backend_choice() -> None:
    cpu = torch.device("cpu")
    assert use_packed_linears("torch", cpu, torch.float32) is False
    assert use_packed_linears("auto", cpu, torch.bfloat16) is False
    assert use_packed_linears("auto", torch.device("cuda"), torch.float32) is False
    assert use_packed_linears("auto", cpu, torch.float32) is onednn_available()
    with pytest.raises(ValueError, match="needs a float32 model on CPU"):
        use_packed_linears("onednn", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="linear_backend must be one of"):
        use_packed_linears("mkl", cpu, torch.float32)


@needs_onednn
def test_engine_packs_the_model_and_its_tied_head() -> None:
    from conveyor import LLM, SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 11, 3 + i]} for i in range(3)]
    packed = LLM("tiny", load_format="dummy", dtype="float32", linear_backend="onednn")
    plain = LLM("tiny", load_format="dummy", dtype="float32", linear_backend="torch")
    assert packed.engine.runner.packed_linears and not plain.engine.runner.packed_linears
    model = packed.engine.runner.model
    assert model.packed_lm_head is not None
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    got = [o.outputs[0].token_ids for o in packed.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert got == want
