"""The CSR page table FlashInfer's wrappers take, against a plain loop."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conveyor.model.attention.page_table import csr_page_table


@given(st.integers(1, 8), st.lists(st.integers(1, 70), min_size=1, max_size=6),
       st.randoms(use_true_random=False))
def test_csr_page_table_matches_a_loop(page_size, lens, rnd) -> None:
    width = max(-(-n // page_size) for n in lens) + rnd.randint(0, 2)  # padding columns
    tables = [[rnd.randrange(1000) for _ in range(width)] for _ in lens]
    got = csr_page_table(torch.tensor(tables), torch.tensor(lens), page_size)
    indptr, indices, last = [0], [], []
    for table, n in zip(tables, lens):
        pages = -(-n // page_size)
        indices += table[:pages]
        indptr.append(indptr[-1] + pages)
        last.append(n - (pages - 1) * page_size)
    assert got.kv_indptr.tolist() == indptr and got.kv_indices.tolist() == indices
    assert got.kv_last_page_len.tolist() == last
    assert {t.dtype for t in (got.kv_indptr, got.kv_indices, got.kv_last_page_len)} == {
        torch.int32}
    assert all(1 <= v <= page_size for v in last)


def test_bad_tables_are_refused() -> None:
    with pytest.raises(ValueError, match="fit the block table"):
        csr_page_table(torch.zeros(2, 1, dtype=torch.int64), torch.tensor([16, 17]), 16)
    with pytest.raises(ValueError, match=">= 1"):
        csr_page_table(torch.zeros(1, 2, dtype=torch.int64), torch.tensor([0]), 16)
    with pytest.raises(ValueError, match=r"\[B, max_blocks\]"):
        csr_page_table(torch.zeros(3, dtype=torch.int64), torch.tensor([1, 1, 1]), 16)
