"""A step's ``BatchShape`` (``conveyor.costs.shape``), read off a ``SchedulerOutput``.

Rows follow the runner's split: a row computing one token is a decode (it reads its
whole context from the KV cache), a row computing more is a prefill chunk; a request
verifying drafts is one decode row per token.
"""

from __future__ import annotations

from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.costs.shape import BatchShape


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
