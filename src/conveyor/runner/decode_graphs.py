"""Decode-only steps at padded batch sizes through static buffers; on CUDA each size is
captured once as a CUDA graph and replayed (``--enforce-eager`` turns them off).

A decode step of B rows runs at the smallest padded size P >= B: its inputs are copied
into persistent buffers whose first P rows the graph of size P reads, the padding rows
with no query (q_len 0) and no KV write (slot -1), so they cost a few idle programs and
change nothing. The attention is the ``triton`` backend's unified kernel (its sequence
table bound to the buffers: nothing is built per step, so the whole forward pass can be
captured). A step with a prefill, more rows than the largest size or a context past the
buffers' width runs eagerly as before. Without capture (CPU tests) the same buffers and
padding run eagerly: what the graphs replay is exercised there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from conveyor.model.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from conveyor.runner.model_runner import ModelRunner

SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_batch: int, max_context: int,
                 capture: bool) -> None:
        assert getattr(runner.decode_kernel, "bind", None) is not None, \
            "decode graphs need the triton attention backend"
        self.runner = runner
        self.capture = capture
        self.sizes = sorted({s for s in SIZES if s < max_batch} | {max_batch})
        dev, p = runner.device, max_batch
        bs = runner.block_size
        self.width = -(-max_context // bs) * bs  # context slots a row can hold
        self.ids = torch.zeros(p, dtype=torch.long, device=dev)
        self.pos = torch.zeros(p, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((p,), -1, dtype=torch.long, device=dev)
        self.slots = torch.zeros(p, self.width, dtype=torch.long, device=dev)
        self.lens = torch.zeros(p, dtype=torch.int32, device=dev)
        self.starts = torch.zeros(p, dtype=torch.int32, device=dev)
        self.q_start = torch.arange(p, dtype=torch.int32, device=dev)
        self.q_len = torch.zeros(p, dtype=torch.int32, device=dev)
        self.metas: dict[int, AttentionMetadata] = {}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self.num_replays = 0  # decode steps served here (tests, logs)

    def _meta(self, p: int) -> AttentionMetadata:
        meta = self.metas.get(p)
        if meta is None:
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping[:p], num_decodes=p,
                decode_slots=self.slots[:p], decode_lens=self.lens[:p],
                decode_starts=self.starts[:p], decode_kernel=self.runner.decode_kernel,
                sliding_window=self.runner.sliding_window)
            self.metas[p] = meta
        self.runner.decode_kernel.bind(meta, (self.slots[:p], self.q_start[:p],
                                              self.q_len[:p], self.lens[:p],
                                              self.starts[:p], 1))
        return meta

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor | None:
        """The step's hidden states [B, hidden], or None where it does not apply."""
        b = meta.num_decodes
        if meta.prefills or not b or b > self.sizes[-1] \
                or meta.decode_slots.shape[1] > self.width:
            return None
        p = next(s for s in self.sizes if s >= b)
        w = meta.decode_slots.shape[1]
        self.ids[:b].copy_(input_ids)
        self.pos[:b].copy_(positions)
        self.slot_mapping[:b].copy_(meta.slot_mapping)
        self.slot_mapping[b:p].fill_(-1)
        self.slots[:b, :w].copy_(meta.decode_slots)  # (past a row's length: never read)
        self.lens[:b].copy_(meta.decode_lens)
        self.lens[b:p].zero_()
        self.starts[:b].copy_(meta.decode_starts)
        self.starts[b:p].zero_()
        self.q_len[:b].fill_(1)
        self.q_len[b:p].zero_()
        static_meta = self._meta(p)
        self.num_replays += 1
        if not self.capture:
            return self._forward(p, static_meta)[:b]
        if p not in self.graphs:
            self.graphs[p] = self._record(p, static_meta)
        graph, out = self.graphs[p]
        graph.replay()
        return out[:b]

    def _forward(self, p: int, meta: AttentionMetadata) -> torch.Tensor:
        r = self.runner
        return r.model(self.ids[:p], self.pos[:p], meta, r.kv_caches)

    def _record(self, p: int, meta: AttentionMetadata):
        """Warm the kernels (Triton compiles on first launch) on a side stream, then
        capture the forward pass at size ``p`` (graphs share one memory pool)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(p, meta)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(p, meta)
        return graph, out
