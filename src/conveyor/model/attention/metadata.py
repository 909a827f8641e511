"""What one step's attention needs besides q, k and v: where each token's K/V is written,
the decode group's context slots and lengths, the prefill segments, and the kernels the
runner chose (see ``paged.py`` for how a step's batch is laid out)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSegment:
    start: int  # first token of the segment in the flat batch
    length: int  # query tokens
    # Slots of the whole context (cached prefix + this chunk), or None for a fresh prompt
    # that attends to its own new K/V only.
    ctx_slots: torch.Tensor | None = None
    # [length, ctx_len] bool, True = attend; None means plain causal (fresh prompt).
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each token's K/V is written
    num_decodes: int = 0
    decode_slots: torch.Tensor | None = None  # [num_decodes, max_ctx] int64, padded
    decode_lens: torch.Tensor | None = None  # [num_decodes] int32 context lengths
    decode_starts: torch.Tensor | None = None  # [num_decodes] int32 first attended position
    decode_mask: torch.Tensor | None = None  # [num_decodes, max_ctx] bool (SDPA only)
    # An attention backend's decode kernel: (q, k_cache, v_cache, meta, scale) -> out.
    decode_kernel: Callable | None = None
    prefills: list[PrefillSegment] = field(default_factory=list)
    # For a fresh prompt's causal attention: (q, k, v, out, scale) -> True if it wrote
    # ``out`` (the native kernel), False to leave the segment to SDPA; None: SDPA always.
    # One with a ``varlen(q, k, v, out, segments, scale)`` method takes all the fresh
    # prompts of a layer in one call (segments: ``fresh_segments()``).
    prefill_kernel: Callable | None = None
    # The model's sliding window (None: none), for kernels that mask by position (triton).
    sliding_window: int | None = None
    _fresh: torch.Tensor | None = field(default=None, init=False, repr=False)
    # Per-layer sliding windows (Gemma 2/3): the step's metadata for each window a layer
    # may have (None: full attention), the same tokens and slots with other decode starts
    # and prefill masks. Empty where every layer has the same window (this object).
    by_window: dict[int | None, AttentionMetadata] = field(default_factory=dict)

    def for_window(self, window: int | None) -> AttentionMetadata:
        """The metadata of a layer with this window; a layer of a mixed-window model must
        find its view (built by the runner), never fall back on another window's."""
        view = self.by_window.get(window)
        if view is None:
            raise ValueError(f"no attention metadata for sliding window {window}: a model "
                             "with per-layer windows needs the runner's by_window views")
        return view

    def fresh_segments(self) -> torch.Tensor:
        """[2, S] int32: the first rows and lengths of the fresh prompts (no cached
        prefix, no mask), built on the first layer's call and shared by the rest."""
        if self._fresh is None:
            fresh = [(p.start, p.length) for p in self.prefills
                     if p.ctx_slots is None and p.mask is None]
            self._fresh = torch.tensor(fresh, dtype=torch.int32).reshape(-1, 2).t().contiguous()
        return self._fresh
