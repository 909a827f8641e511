"""A step's sequences as one table, for kernels that take the whole step at once (the
``triton`` and ``flashinfer`` backends): decode rows first, as the runner laid them out,
then one row per prefill segment."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from conveyor.model.attention.metadata import AttentionMetadata


@dataclass
class StepSequences:
    slots: torch.Tensor  # [S, W] int64: the cache slot of each context position (padded)
    q_start: torch.Tensor  # [S] int32: first query row in the flat batch
    q_len: torch.Tensor  # [S] int32
    ctx_len: torch.Tensor  # [S] int32: cached prefix + this step's tokens
    kv_lo: torch.Tensor  # [S] int32: first attended position (a decode row's window start)
    max_q_len: int

    def as_tuple(self) -> tuple:
        return (self.slots, self.q_start, self.q_len, self.ctx_len, self.kv_lo, self.max_q_len)


def step_sequences(meta: AttentionMetadata, decodes_only: bool = False) -> StepSequences:
    """The table of ``meta``'s sequences (a fresh prompt's slots are its own new ones)."""
    dev = meta.slot_mapping.device
    nd = meta.num_decodes
    segs = [] if decodes_only else meta.prefills
    ctx = [p.length if p.ctx_slots is None else int(p.ctx_slots.numel()) for p in segs]
    width = max([*ctx, meta.decode_slots.shape[1] if nd else 0, 1])
    slots = torch.zeros(nd + len(segs), width, dtype=torch.int64, device=dev)
    if nd:
        slots[:nd, :meta.decode_slots.shape[1]] = meta.decode_slots
    for i, p in enumerate(segs):
        own = (meta.slot_mapping[p.start:p.start + p.length] if p.ctx_slots is None
               else p.ctx_slots)
        slots[nd + i, :ctx[i]] = own
    host = [list(range(nd)) + [p.start for p in segs], [1] * nd + [p.length for p in segs]]
    q_start, q_len = (torch.tensor(x, dtype=torch.int32, device=dev) for x in host)
    zeros = torch.zeros(len(segs), dtype=torch.int32, device=dev)
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=dev)
    if nd:
        ctx_t = torch.cat([meta.decode_lens.to(torch.int32), ctx_t])
        kv_lo = torch.cat([meta.decode_starts.to(torch.int32), zeros])
    else:
        kv_lo = zeros
    return StepSequences(slots, q_start, q_len, ctx_t, kv_lo, max(host[1], default=1))
