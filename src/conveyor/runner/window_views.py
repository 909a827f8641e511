"""Per-layer sliding windows (Gemma 2's alternating layers, Gemma 3's pattern): a step's
attention metadata for each window a layer may have.

The runner builds the step's metadata once, for the model-level window (None where the
layers' windows differ); each other window gets a view of it here with the same tokens,
slots and kernels but its own decode starts (and SDPA mask) and prefill masks. A layer
then reads ``meta.for_window(its window)`` (``AttentionMetadata.by_window``).

A hybrid model whose windowed layers keep their own block table (``core/kv_groups.py``)
hands that window its own ``GroupTables``: the view then also writes and reads through
that table's slots (its slot mapping, decode slots and prefill context slots), in the
windowed layers' own KV tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from conveyor.model.attention.metadata import AttentionMetadata, PrefillSegment
from conveyor.runner.decode_layout import attended, window_starts

# (first token in the flat batch, query tokens, first position, block table) of a chunk.
PrefillArgs = tuple[int, int, int, np.ndarray]


@dataclass
class GroupTables:
    """A layer group's own block tables for the step: where its layers write each token's
    K/V, the decode rows' padded context slots, and the prefill chunks' arguments (with
    the group's table)."""

    slot_mapping: torch.Tensor
    decode_slots: torch.Tensor | None
    prefill_args: list[PrefillArgs]


def add_window_views(meta: AttentionMetadata, base_window: int | None,
                     windows: list[int | None], prefill_args: list[PrefillArgs],
                     decode_lens: list[int],
                     make_segment: Callable[[int, int, int, np.ndarray, int | None],
                                            PrefillSegment],
                     own_tables: dict[int | None, GroupTables] | None = None) -> None:
    """Fill ``meta.by_window``: ``meta`` itself for ``base_window``, a view for each
    other of ``windows``. ``make_segment(cursor, n, start, table, window)`` builds a
    prefill segment as the runner does for the model-level window. ``own_tables``: the
    windows whose layers keep their own block tables (a hybrid model's windowed group)."""
    meta.by_window = {base_window: meta}
    lens = np.asarray(decode_lens, dtype=np.int32)
    own_tables = own_tables or {}
    for window in windows:
        if window == base_window:
            continue
        tables = own_tables.get(window)
        view = dataclasses.replace(
            meta, prefills=[make_segment(*args, window) for args in
                            (tables.prefill_args if tables is not None else prefill_args)],
            by_window={}, sliding_window=window)
        if tables is not None:
            view.slot_mapping = tables.slot_mapping
            view.decode_slots = tables.decode_slots
        if decode_lens:
            starts = window_starts(lens, window)
            view.decode_starts = torch.from_numpy(starts).to(meta.slot_mapping.device)
            if meta.decode_mask is not None:
                view.decode_mask = torch.from_numpy(attended(
                    meta.decode_mask.shape[1], lens, starts)).to(meta.slot_mapping.device)
        meta.by_window[window] = view
    for view in meta.by_window.values():
        view.by_window = meta.by_window
