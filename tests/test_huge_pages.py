"""The KV pool on huge pages: the same zero tensor whatever the OS does with the advice."""

from __future__ import annotations

import pytest
import torch

from conveyor.runner import huge_pages


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_is_a_contiguous_zero_tensor_of_the_shape(dtype) -> None:
    shape = (3, 2, 40_000, 3, 64)  # 46-92 MB: above the advice's threshold
    t, advised = huge_pages.zeros(shape, dtype)
    assert t.shape == shape and t.dtype is dtype and t.is_contiguous()
    assert not t.any()
    if advised:  # the advised range starts at a huge page boundary
        assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    t[1, 0, 5].fill_(1.0)  # a view of one allocation: writes land where they should
    assert t.sum().item() == 3 * 64


def test_small_tensors_and_the_switch_skip_the_advice(monkeypatch) -> None:
    t, advised = huge_pages.zeros((16, 4), torch.float32)
    assert not advised and t.shape == (16, 4) and not t.any()
    monkeypatch.setenv("CONVEYOR_HUGE_PAGES", "0")
    t, advised = huge_pages.zeros((3, 2, 40_000, 3, 64), torch.float32)
    assert not advised and not t.any()


def test_the_engines_kv_caches_are_views_of_one_pool() -> None:
    from conveyor import LLM, SamplingParams

    llm = LLM(model="tiny", load_format="dummy", dtype="float32", num_kv_blocks=64,
              max_num_seqs=4)
    caches = llm.engine.runner.kv_caches
    base = caches[0][0].untyped_storage().data_ptr()
    assert all(k.untyped_storage().data_ptr() == base == v.untyped_storage().data_ptr()
               for k, v in caches)
    assert len({k.data_ptr() for k, _ in caches} | {v.data_ptr() for _, v in caches}) \
        == 2 * len(caches)
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4
