"""The ``flashinfer`` backend's CPU-side part: the step's FlashInfer plan inputs (qo_indptr
and the CSR page table at page size 1) from a step's metadata, and its ``supports``
refusing what it cannot run. Its kernels run in tests/test_gpu.py (CUDA only)."""

from __future__ import annotations

import pytest
import torch

from conveyor.model.attention.metadata import AttentionMetadata, PrefillSegment
from conveyor.model.attention.registry import select_attention_backend
from conveyor.model.attention.sequences import step_sequences
from conveyor.model.backend_registry import BackendUnavailableError


def _meta() -> AttentionMetadata:
    # two decodes (contexts 3 and 5), a fresh prompt of 4, a chunk of 2 after 3 cached
    return AttentionMetadata(
        slot_mapping=torch.tensor([12, 41, 60, 61, 62, 63, 83, 84]), num_decodes=2,
        decode_slots=torch.tensor([[10, 11, 12, 0, 0], [37, 38, 39, 40, 41]]),
        decode_lens=torch.tensor([3, 5], dtype=torch.int32),
        decode_starts=torch.zeros(2, dtype=torch.int32),
        prefills=[PrefillSegment(2, 4), PrefillSegment(
            6, 2, torch.tensor([80, 81, 82, 83, 84]), torch.ones(2, 5, dtype=torch.bool))])


def test_plan_inputs_are_the_step_table_at_page_size_one() -> None:
    from conveyor.model.attention.flashinfer_backend import plan_inputs

    qo_indptr, paged = plan_inputs(step_sequences(_meta()))
    assert qo_indptr.tolist() == [0, 1, 2, 6, 8]
    assert paged.kv_indptr.tolist() == [0, 3, 8, 12, 17]
    assert paged.kv_indices.tolist() == [10, 11, 12, 37, 38, 39, 40, 41, 60, 61, 62, 63,
                                         80, 81, 82, 83, 84]
    assert paged.kv_last_page_len.tolist() == [1, 1, 1, 1]
    assert qo_indptr.dtype == paged.kv_indptr.dtype == paged.kv_indices.dtype == torch.int32


@pytest.mark.parametrize("device,dtype,reason", [
    ("cpu", torch.float16, "needs a CUDA device"),
    ("cuda", torch.float32, "needs a float16 or bfloat16 model"),
])
def test_flashinfer_says_why_it_does_not_apply(device, dtype, reason) -> None:
    with pytest.raises(BackendUnavailableError, match=reason):
        select_attention_backend("flashinfer", device, dtype, 8, 2, 64)
