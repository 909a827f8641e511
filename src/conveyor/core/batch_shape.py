"""What a cost model sees of one step: the batch's shape, read off a ``SchedulerOutput``.

In the core (no numpy, no torch) because the scheduler's token-budget controller
(``core/budget.py``) prices candidate batches with it; ``conveyor.sim.batch`` re-exports it.

Rows follow the runner's split: a row computing one token is a decode (it reads its
whole context from the KV cache), a row computing more is a prefill chunk (causal
attention over the chunk plus the context computed before it).
"""

from __future__ import annotations

from typing import NamedTuple

from conveyor.core.scheduler_output import SchedulerOutput


class BatchShape(NamedTuple):
    """Immutable and hashable; a NamedTuple because one is built every simulated step."""

    num_prefill_tokens: int = 0  # tokens of the rows computing more than one token
    num_prefills: int = 0
    # Query-key pairs of the prefill rows: a chunk of n tokens after s computed ones
    # attends n*s + n(n+1)/2 pairs.
    prefill_attention: int = 0
    # KV tokens the prefill rows read or write (s + n per row).
    prefill_context: int = 0
    num_decodes: int = 0
    decode_context: int = 0  # sum of the decode rows' context lengths (KV tokens read)
    # The longest: conveyor's CPU/torch runner pads every decode row to it.
    max_decode_context: int = 0
    num_sampled: int = 0  # rows that reach their end and sample (LM head rows)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decodes

    @property
    def attention_pairs(self) -> int:
        return self.prefill_attention + self.decode_context

    @property
    def kv_tokens_read(self) -> int:
        return self.prefill_context + self.decode_context


def batch_shape(out: SchedulerOutput) -> BatchShape:
    scheduled = out.num_scheduled_tokens
    p_tokens = p_rows = p_attn = p_ctx = d_rows = d_ctx = d_max = 0
    spec = out.scheduled_spec_tokens
    for rows in (out.new_reqs, out.cached_reqs):
        for row in rows:
            n = scheduled[row.req_id]
            start = row.num_computed_tokens
            if spec and row.req_id in spec:
                # Verifying drafts: one decode row per token, each reading up to itself.
                d_rows += n
                d_ctx += n * start + n * (n + 1) // 2
                d_max = max(d_max, start + n)
                continue
            if n == 1:
                d_rows += 1
                d_ctx += start + 1
                if start >= d_max:
                    d_max = start + 1
            else:
                p_tokens += n
                p_rows += 1
                p_attn += n * start + n * (n + 1) // 2
                p_ctx += start + n
    num_sampled = len(out.sampling_req_ids) + sum(len(d) for d in spec.values())
    return BatchShape(p_tokens, p_rows, p_attn, p_ctx, d_rows, d_ctx, d_max, num_sampled)


def prefill_and_decode_rows(out: SchedulerOutput) -> tuple[int, int]:
    """``batch_shape(out)``'s (num_prefill_tokens, num_decodes) alone, for the
    per-step step-cost fit: one pass over the scheduled counts, no attention terms."""
    total = out.total_num_scheduled_tokens
    if total == len(out.num_scheduled_tokens):
        return 0, total  # a token a row: all decodes (the common step, at any batch size)
    spec = out.scheduled_spec_tokens
    prefill = 0
    for rid, n in out.num_scheduled_tokens.items():
        if n > 1 and rid not in spec:
            prefill += n
    return prefill, total - prefill
