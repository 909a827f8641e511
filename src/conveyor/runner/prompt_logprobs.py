"""Prompt logprobs: each prompt token's log-probability given the tokens before it, with
its rank and the top-k alternatives, from the hidden rows of a prefill chunk.

Only requests that ask pay for them, and memory stays bounded: their rows' logits are
computed a slice of at most ``SLICE_ROWS`` rows at a time, and only (top ids, top
logprobs, rank, logprob) per token leaves the step, never a vocabulary-wide row.
The numbers are the sampler's own: ``log_softmax`` of the float32 logits.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from conveyor.runner.request_state import RequestState

# Rows of logits held at once (a slice is SLICE_ROWS x vocabulary float32 values).
SLICE_ROWS = 256

ScoredToken = tuple[list[int], list[float], int, float]


@dataclass
class PromptSpan:
    """A request's scored positions in this step's flat batch."""

    req_id: str
    row: int  # the hidden row of its first scored position
    first: int  # the prompt index of the first token scored (>= 1)
    targets: list[int]  # the prompt tokens scored, in order
    k: int  # top alternatives asked for


def prompt_spans(order: list[str], num_scheduled: Mapping[str, int],
                 requests: Mapping[str, RequestState]) -> list[PromptSpan]:
    """The spans of this step's requests that asked. Rows follow ``order`` (as the runner
    lays out the batch); position p's logits score prompt token p + 1, so a chunk of
    positions [s, e) scores tokens s + 1 .. min(e, P - 1) of a P-token prompt (the last
    prompt position's logits sample the first output token instead)."""
    spans: list[PromptSpan] = []
    cursor = 0
    for rid in order:
        n = num_scheduled[rid]
        state = requests[rid]
        k = state.params.prompt_logprobs
        if k is not None:
            start = state.num_computed_tokens
            end = min(start + n, len(state.prompt_token_ids) - 1)
            if end > start:
                spans.append(PromptSpan(rid, cursor, start + 1,
                                        state.prompt_token_ids[start + 1:end + 1], k))
        cursor += n
    return spans


def compute_prompt_logprobs(hidden: torch.Tensor, spans: list[PromptSpan],
                            compute_logits: Callable[[torch.Tensor], torch.Tensor],
                            slice_rows: int = SLICE_ROWS
                            ) -> dict[str, tuple[int, list[ScoredToken]]]:
    """req_id -> (first prompt index scored, one entry per scored token)."""
    device = hidden.device
    rows = torch.cat([torch.arange(s.row, s.row + len(s.targets), device=device)
                      for s in spans])
    targets = torch.tensor([t for s in spans for t in s.targets], dtype=torch.long,
                           device=device)
    k_max = max(s.k for s in spans)
    token_lps, ranks, top_ids, top_lps = [], [], [], []
    for lo in range(0, rows.numel(), slice_rows):
        hi = min(lo + slice_rows, rows.numel())
        logprobs = torch.log_softmax(compute_logits(hidden[rows[lo:hi]]).float(), dim=-1)
        scored = logprobs.gather(1, targets[lo:hi, None])
        token_lps.append(scored[:, 0])
        # An int32 count: the default int64 sum of a bool tensor is several times slower.
        ranks.append((logprobs > scored).sum(dim=1, dtype=torch.int32) + 1)
        if k_max == 1:  # max is one cheap pass; topk is not
            values, indices = logprobs.max(dim=-1, keepdim=True)
            top_ids.append(indices)
            top_lps.append(values)
        elif k_max:
            top = torch.topk(logprobs, k_max, dim=-1)
            top_ids.append(top.indices)
            top_lps.append(top.values)
        del logprobs
    lp_list = torch.cat(token_lps).tolist()
    rank_list = torch.cat(ranks).tolist()
    ids_list = torch.cat(top_ids).tolist() if k_max else None
    vals_list = torch.cat(top_lps).tolist() if k_max else None
    out: dict[str, tuple[int, list[ScoredToken]]] = {}
    i = 0
    for s in spans:
        entries: list[ScoredToken] = []
        for _ in s.targets:
            ids = ids_list[i][:s.k] if ids_list is not None else []
            vals = vals_list[i][:s.k] if vals_list is not None else []
            entries.append((ids, vals, rank_list[i], lp_list[i]))
            i += 1
        out[s.req_id] = (s.first, entries)
    return out
