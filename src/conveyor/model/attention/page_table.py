"""The paged KV layout that FlashInfer's batch attention wrappers take (CSR over pages).

For a batch of sequences with block tables (our block ids, page size = our block size)
and KV lengths, FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper.plan`` and
``BatchPrefillWithPagedKVCacheWrapper.plan`` take three int32 tensors:

    kv_indptr        [B + 1]   sequence i's pages are kv_indices[kv_indptr[i]:kv_indptr[i+1]]
    kv_indices       [nnz]     the page (block) ids, sequence after sequence
    kv_last_page_len [B]       tokens in each sequence's last page, 1..page_size

Built from a padded ``[B, max_blocks]`` block-table tensor in a few vectorized ops, on
whatever device the tensors live (once per step on the GPU, no host loop). Our
per-layer cache ``[num_blocks * block_size, Hkv, D]`` is FlashInfer's NHD layout as the
view ``[num_blocks, block_size, Hkv, D]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedKV:
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


def csr_page_table(block_tables: torch.Tensor, kv_lens: torch.Tensor,
                   page_size: int) -> PagedKV:
    """``block_tables`` [B, max_blocks] (entries past a sequence's pages are ignored),
    ``kv_lens`` [B] >= 1 tokens of KV per sequence (the new ones included)."""
    if block_tables.dim() != 2 or kv_lens.shape != (block_tables.shape[0],):
        raise ValueError(f"block_tables must be [B, max_blocks] and kv_lens [B], got "
                         f"{tuple(block_tables.shape)} and {tuple(kv_lens.shape)}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    lens = kv_lens.to(torch.int64)
    pages = (lens + page_size - 1) // page_size
    if bool((lens < 1).any()) or bool((pages > block_tables.shape[1]).any()):
        raise ValueError("every kv_len must be >= 1 and fit the block table's width")
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=block_tables.device)
    indptr[1:] = torch.cumsum(pages, 0)
    cols = torch.arange(block_tables.shape[1], device=block_tables.device)
    indices = block_tables[cols.unsqueeze(0) < pages.unsqueeze(1)].to(torch.int32)
    last = (lens - (pages - 1) * page_size).to(torch.int32)
    return PagedKV(indptr, indices, last)
