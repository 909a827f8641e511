"""Per-layer sliding windows (Gemma 2's alternating layers, Gemma 3's pattern): a step's
attention metadata for each window a layer may have.

The runner builds the step's metadata once, for the model-level window (None where the
layers' windows differ); each other window gets a view of it here with the same tokens,
slots and kernels but its own decode starts (and SDPA mask) and prefill masks. A layer
then reads ``meta.for_window(its window)`` (``AttentionMetadata.by_window``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from conveyor.model.attention.metadata import AttentionMetadata, PrefillSegment
from conveyor.runner.decode_layout import attended, window_starts

# (first token in the flat batch, query tokens, first position, block table) of a chunk.
PrefillArgs = tuple[int, int, int, np.ndarray]


def add_window_views(meta: AttentionMetadata, base_window: int | None,
                     windows: list[int | None], prefill_args: list[PrefillArgs],
                     decode_lens: list[int],
                     make_segment: Callable[[int, int, int, np.ndarray, int | None],
                                            PrefillSegment]) -> None:
    """Fill ``meta.by_window``: ``meta`` itself for ``base_window``, a view for each
    other of ``windows``. ``make_segment(cursor, n, start, table, window)`` builds a
    prefill segment as the runner does for the model-level window."""
    meta.by_window = {base_window: meta}
    lens = np.asarray(decode_lens, dtype=np.int32)
    for window in windows:
        if window == base_window:
            continue
        view = dataclasses.replace(
            meta, prefills=[make_segment(*args, window) for args in prefill_args],
            by_window={}, sliding_window=window)
        if decode_lens:
            starts = window_starts(lens, window)
            view.decode_starts = torch.from_numpy(starts).to(meta.slot_mapping.device)
            if meta.decode_mask is not None:
                view.decode_mask = torch.from_numpy(attended(
                    meta.decode_mask.shape[1], lens, starts)).to(meta.slot_mapping.device)
        meta.by_window[window] = view
    for view in meta.by_window.values():
        view.by_window = meta.by_window
