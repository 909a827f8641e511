"""The ``triton`` attention backend: the KV write and one unified kernel for the decode
rows and prefill chunks of a step (``triton_kernels.py``), on CUDA, or on the CPU under
Triton's interpreter (``TRITON_INTERPRET=1``: for tests, never fast).

``paged.paged_attention`` hands the whole layer to ``TritonAttention.unified`` (the decode
kernel's ``unified`` attribute): one launch for every sequence of the step, whatever mix
of decodes, fresh prompts and chunks after a cached prefix. Called as a plain decode
kernel (the backend protocol; ``autotune`` times it so) it runs the decode rows alone.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from conveyor.model.attention.backend import AttentionBackend
from conveyor.model.attention.metadata import AttentionMetadata


class TritonAttention:
    """The step's sequence table built once from the metadata (shared by every layer of
    the step) and the kernels launched per layer."""

    needs_mask = False  # the kernel masks by position; the runner builds no decode mask

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._table: tuple | None = None

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Decode rows only: ``q`` [num_decodes, Hq, D], their K/V already written."""
        from conveyor.model.attention import triton_kernels as tk

        out = torch.empty_like(q)
        table = self._sequences(meta, decodes_only=True)
        tk.unified_attention(q, k_cache, v_cache, out, *table[:5], table[5], scale,
                             window=_window(meta))
        return out

    def unified(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: int | None = None,
                softcap: float | None = None) -> torch.Tensor:
        """The whole layer: K/V written at ``meta.slot_mapping``, then every query.
        ``window`` (default: the metadata's) keeps the last positions; ``softcap`` caps
        the scores (the families of issue 47 pass them per layer)."""
        from conveyor.model.attention import triton_kernels as tk

        tk.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        table = self._sequences(meta)
        tk.unified_attention(q, k_cache, v_cache, out, *table[:5], table[5], scale,
                             softcap=softcap or 0.0,
                             window=_window(meta) if window is None else window)
        return out

    def bind(self, meta: AttentionMetadata, table: tuple) -> None:
        """Use ``table`` (``_sequences``' layout) for ``meta``: a CUDA graph's static
        buffers (runner/decode_graphs.py), nothing built per step."""
        self._meta, self._table = meta, table

    def _sequences(self, meta: AttentionMetadata, decodes_only: bool = False) -> tuple:
        """``sequences.step_sequences`` as a tuple, built once per step (every layer's
        call shares it)."""
        from conveyor.model.attention.sequences import step_sequences

        if meta is self._meta and not decodes_only:
            return self._table
        table = step_sequences(meta, decodes_only).as_tuple()
        if not decodes_only:
            self._meta, self._table = meta, table
        return table


def _window(meta: AttentionMetadata) -> int:
    return getattr(meta, "sliding_window", None) or 0


class TritonAttentionBackend(AttentionBackend):
    """One Triton kernel for decode and prefill over the paged cache: CUDA (float16,
    bfloat16, float32), or the CPU under the interpreter (float32, float16: its bfloat16
    arithmetic is wrong, triton #11584)."""

    name = "triton"

    @classmethod
    def supports(cls, device, dtype, num_heads, num_kv_heads, head_dim=None):
        # Without importing triton (auto asks every backend): a process that imports it
        # prints its bindings' "leaked function" warnings at exit.
        interpret = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
        if device.type != "cuda" and not interpret:
            return "needs a CUDA device (or the CPU under TRITON_INTERPRET=1, for tests)"
        if importlib.util.find_spec("triton") is None:
            return "triton is not installed (pip install 'conveyor[triton]')"
        if num_heads % num_kv_heads:
            return "needs the query heads a multiple of the KV heads"
        if device.type == "cuda":
            return None if dtype in (torch.float16, torch.bfloat16, torch.float32) else \
                "needs a float16, bfloat16 or float32 model"
        from conveyor.model.attention import triton_kernels as tk

        if not tk.interpreted():
            return "TRITON_INTERPRET=1 was set after triton was imported"
        return None if dtype in (torch.float16, torch.float32) else \
            "runs float32 or float16 under Triton's interpreter (its bfloat16 is wrong)"

    def decode_kernel(self) -> TritonAttention:
        return TritonAttention()
