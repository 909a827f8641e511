"""Prompt logprobs: each prompt token's log-probability given the tokens before it, with
its rank and the top-k alternatives, from the hidden rows of a prefill chunk.

Only requests that ask pay for them, and memory stays bounded: their rows' logits are
computed a slice of at most ``SLICE_ROWS`` rows at a time, and only (top ids, top
logprobs, rank, logprob) per token leaves the step, never a vocabulary-wide row.
The numbers are the sampler's own: ``log_softmax`` of the float32 logits. Each slice is
reduced in one pass per row by the native kernel (``kernels/cpu/logprob_rows.c``), or by
torch's passes where the kernels are off or k is beyond it; both rank a token 1 + the
count of logits strictly greater than its own and order the top k by logit, equal logits
lower id first: on the logits, since log_softmax's rounding can tie logits a few ulps
apart, and the two paths would then disagree.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from conveyor.kernels.cpu import logprob_rows
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


def reduce_rows_torch(logits: torch.Tensor, targets: torch.Tensor, k: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token logprob [R], rank [R], top ids [R, k], top logprobs [R, k]) of float32
    ``logits`` [R, V]: torch's passes, the fused kernel's definition (the rank counts
    logits strictly greater; the top k by logit), for where the kernel is off or k is
    beyond it."""
    logprobs = torch.log_softmax(logits, dim=-1)
    token_lp = logprobs.gather(1, targets[:, None])[:, 0]
    # An int32 count: the default int64 sum of a bool tensor is several times slower.
    rank = (logits > logits.gather(1, targets[:, None])).sum(dim=1, dtype=torch.int32) + 1
    if k == 1:  # max is one cheap pass; topk is not
        ids = logits.max(dim=-1, keepdim=True).indices
    else:
        ids = torch.topk(logits, k, dim=-1).indices
    return token_lp, rank, ids, logprobs.gather(1, ids)


def _row_kernel(device: torch.device, k: int):
    """The fused row kernel where it runs these rows (CPU, k within its limit), else None."""
    if device.type != "cpu":
        return None
    lib = logprob_rows.load()
    return lib if lib is not None and k <= logprob_rows.max_k(lib) else None


def compute_prompt_logprobs(hidden: torch.Tensor, spans: list[PromptSpan],
                            compute_logits: Callable[[torch.Tensor], torch.Tensor],
                            slice_rows: int = SLICE_ROWS, use_kernel: bool = True
                            ) -> dict[str, tuple[int, list[ScoredToken]]]:
    """req_id -> (first prompt index scored, one entry per scored token). ``use_kernel``:
    the fused row kernel where it is built (else torch's passes, as without it)."""
    device = hidden.device
    rows = torch.cat([torch.arange(s.row, s.row + len(s.targets), device=device)
                      for s in spans])
    targets = torch.tensor([t for s in spans for t in s.targets], dtype=torch.long,
                           device=device)
    k_max = max(s.k for s in spans)
    lib = _row_kernel(device, k_max) if use_kernel else None
    token_lps, ranks, top_ids, top_lps = [], [], [], []
    for lo in range(0, rows.numel(), slice_rows):
        hi = min(lo + slice_rows, rows.numel())
        logits = compute_logits(hidden[rows[lo:hi]])
        if lib is not None and logits.dtype in (torch.float32, torch.bfloat16) \
                and logits.stride(1) == 1:
            # (bf16 logits read as they are: the kernel widens them as .float() would)
            token_lp, rank, ids, vals = logprob_rows.reduce_rows(logits, targets[lo:hi],
                                                                 k_max, lib)
        else:
            token_lp, rank, ids, vals = reduce_rows_torch(logits.float(), targets[lo:hi],
                                                          k_max)
        token_lps.append(token_lp)
        ranks.append(rank)
        top_ids.append(ids)
        top_lps.append(vals)
        del logits
    lp_list = torch.cat(token_lps).tolist()
    rank_list = torch.cat(ranks).tolist()
    ids_list = torch.cat(top_ids).tolist()
    vals_list = torch.cat(top_lps).tolist()
    out: dict[str, tuple[int, list[ScoredToken]]] = {}
    i = 0
    for s in spans:
        entries: list[ScoredToken] = []
        for _ in s.targets:
            entries.append((ids_list[i][:s.k], vals_list[i][:s.k], rank_list[i], lp_list[i]))
            i += 1
        out[s.req_id] = (s.first, entries)
    return out
