"""Decode rows' context layout over the paged cache: each row's padded cache slots, its
window's first position and, for SDPA, the mask. The runner's and the draft model's
(runner/draft_model.py) decode rows are built from these."""

from __future__ import annotations

import numpy as np


def padded_slots(tables: list[list[int]], max_ctx: int, block_size: int) -> np.ndarray:
    """[len(tables), max_ctx] int64: the cache slot of every context position of each
    block table, padded with slot 0 (block 0 is always allocated memory; never attended)
    past a table's end."""
    max_blocks = -(-max_ctx // block_size)
    bt = np.zeros((len(tables), max_blocks), dtype=np.int64)
    for i, t in enumerate(tables):
        bt[i, :len(t[:max_blocks])] = t[:max_blocks]
    cols = np.arange(max_ctx, dtype=np.int64)
    return np.ascontiguousarray(bt[:, cols // block_size] * block_size + cols % block_size)


def window_starts(lens: np.ndarray, window: int | None) -> np.ndarray:
    """int32 first attended position of each context length (0 without a window)."""
    return (np.maximum(lens - window, 0).astype(np.int32) if window is not None
            else np.zeros_like(lens, dtype=np.int32))


def attended(max_ctx: int, lens: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """[rows, max_ctx] bool: the positions each row attends to (SDPA's mask)."""
    cols = np.arange(max_ctx, dtype=np.int64)
    return (cols[None, :] < lens[:, None]) & (cols[None, :] >= starts[:, None])
