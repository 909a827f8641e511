"""The ``flashinfer`` attention backend (CUDA, float16/bfloat16): FlashInfer's batch
prefill wrapper over the paged cache for the whole step, decode rows and prefill chunks
alike, ``plan`` once a step and ``run`` per layer.

The cache is taken at page size 1 (a page per slot: the view ``[num_slots, 1, Hkv, D]``
of our ``[num_slots, Hkv, D]``, FlashInfer's NHD layout), so the CSR page table
(``page_table.csr_page_table``) is the step's slot table (``sequences.step_sequences``)
and no block size needs to be known here. K/V are written by the triton backend's write
kernel where triton is installed, else by ``index_copy_``.

Not yet run on a GPU (none was lent when it was written): ``tests/test_gpu.py`` holds
it to the SDPA reference in half precision, and ``scripts/gpu_check.sh`` runs those.
"""

from __future__ import annotations

import importlib.util

import torch

from conveyor.model.attention.backend import AttentionBackend
from conveyor.model.attention.metadata import AttentionMetadata
from conveyor.model.attention.page_table import PagedKV, csr_page_table
from conveyor.model.attention.sequences import StepSequences, step_sequences

WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace, allocated once per backend


def plan_inputs(seqs: StepSequences) -> tuple[torch.Tensor, PagedKV]:
    """(qo_indptr [S + 1] int32, the CSR page table at page size 1) of a step."""
    qo_indptr = torch.zeros(len(seqs.q_len) + 1, dtype=torch.int32, device=seqs.q_len.device)
    qo_indptr[1:] = torch.cumsum(seqs.q_len, 0)
    return qo_indptr, csr_page_table(seqs.slots, seqs.ctx_len, page_size=1)


class FlashInferAttention:
    """Plans once per step (the first layer's call) and runs each layer."""

    needs_mask = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 device: torch.device) -> None:
        import flashinfer

        self.heads = (num_heads, num_kv_heads, head_dim)
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self._meta: AttentionMetadata | None = None

    def _plan(self, meta: AttentionMetadata, q: torch.Tensor, kv_dtype: torch.dtype,
              scale: float, window: int | None, softcap: float | None,
              decodes_only: bool = False) -> None:
        if meta is self._meta and not decodes_only:
            return
        seqs = step_sequences(meta, decodes_only)
        if bool((seqs.kv_lo > 0).any()) and not window:
            # (window starts without the metadata's window: a draft model's rows)
            raise NotImplementedError("flashinfer: per-row window starts without a window")
        qo_indptr, paged = plan_inputs(seqs)
        hq, hkv, d = self.heads
        self.wrapper.plan(qo_indptr, paged.kv_indptr, paged.kv_indices,
                          paged.kv_last_page_len, hq, hkv, d, 1, causal=True,
                          sm_scale=scale, window_left=(window - 1) if window else -1,
                          logits_soft_cap=softcap or None, q_data_type=q.dtype,
                          kv_data_type=kv_dtype)
        self._meta = None if decodes_only else meta

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Decode rows only (the backend protocol; autotune times it so)."""
        self._plan(meta, q, k_cache.dtype, scale, meta.sliding_window, None,
                   decodes_only=True)
        return self._run(q, k_cache, v_cache)

    def unified(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        _write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        self._plan(meta, q, k_cache.dtype, scale,
                   meta.sliding_window if window is None else window, softcap)
        return self._run(q, k_cache, v_cache)

    def _run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
             ) -> torch.Tensor:
        pages = (k_cache.unsqueeze(1), v_cache.unsqueeze(1))  # [slots, 1, Hkv, D]
        return self.wrapper.run(q.contiguous(), pages)


def _write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    try:
        from conveyor.model.attention import triton_kernels as tk
    except ImportError:  # pragma: no cover
        tk = None
    if tk is not None and tk.triton is not None:
        tk.write_kv(k, v, k_cache, v_cache, slot_mapping)
    else:
        k_cache.index_copy_(0, slot_mapping, k)
        v_cache.index_copy_(0, slot_mapping, v)


class FlashInferAttentionBackend(AttentionBackend):
    """FlashInfer's paged prefill wrapper for the whole step (CUDA, float16/bfloat16)."""

    name = "flashinfer"

    @classmethod
    def supports(cls, device, dtype, num_heads, num_kv_heads, head_dim=None):
        if device.type != "cuda":
            return "needs a CUDA device"
        if dtype not in (torch.float16, torch.bfloat16):
            return "needs a float16 or bfloat16 model"
        if importlib.util.find_spec("flashinfer") is None:  # (not imported: auto asks)
            return "flashinfer is not installed (pip install 'conveyor[flashinfer]')"
        return None

    def decode_kernel(self) -> FlashInferAttention:
        return FlashInferAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.device)
