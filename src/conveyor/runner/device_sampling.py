"""The sampler's per-step work as batched tensor ops on the logits' device, with one
device-to-host copy of the step's results (tokens, and the logprobs rows asked for).

Per-row host data (penalty scalars, token histories, stop ids) is laid out in numpy and
reaches the device in one copy per array, through persistent pinned buffers on CUDA
(``HostStaging``: no pageable copy that blocks the host, no allocation per step). Nothing
here reads a device value back before the step's single ``results`` copy, so the host
can queue the step's whole sampling behind the forward pass.

The values are the per-row loops' bit for bit (``tests/test_device_sampler.py`` holds
the loops as the reference): the same float32 operations in the same order, on rows
whose neutral parameters (repetition 1, frequency and presence 0) leave them unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from conveyor.runner.sampler import SamplingRow
    from conveyor.sampling_params import SamplingParams

Logprob = tuple[list[int], list[float], int, float]


class HostStaging:
    """numpy arrays to the device: a persistent pinned buffer per name on CUDA (grown as
    needed) and a non-blocking copy; on the CPU, the array itself."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._buffers: dict[str, torch.Tensor] = {}
        self._copied: dict[str, torch.cuda.Event] = {}  # each buffer's last copy

    def to_device(self, name: str, array: np.ndarray) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(array))
        if not self.pinned:
            return host
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < host.numel() or buf.dtype != host.dtype:
            buf = torch.empty(max(host.numel(), 1024), dtype=host.dtype, pin_memory=True)
            self._buffers[name] = buf
        # A pinned buffer is rewritten only once its last copy has left (usually long
        # done: the step's results came back since; waited for where a step stages the
        # same name twice).
        done = self._copied.get(name)
        if done is not None:
            done.synchronize()
        view = buf[:host.numel()].view(host.shape)
        view.copy_(host)
        out = view.to(self.device, non_blocking=True)
        event = self._copied.setdefault(name, torch.cuda.Event())
        event.record()
        return out


def _padded(seqs: Sequence[Sequence[int]], fill: int) -> np.ndarray:
    width = max((len(s) for s in seqs), default=0)
    out = np.full((len(seqs), max(width, 1)), fill, dtype=np.int64)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s
    return out


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], vocab: int,
                    staging: HostStaging) -> torch.Tensor:
    """Repetition (prompt and output tokens seen), then frequency and presence (output
    counts) for every row in a few batched ops; rows without penalties are unchanged."""
    params = [r.params for r in rows]
    n = len(rows)
    dev, dt = logits.device, logits.dtype
    # Token histories padded with ``vocab``: one extra column that absorbs the padding.
    outs = staging.to_device("pen_out", _padded([r.output_token_ids for r in rows], vocab))
    counts = torch.zeros(n, vocab + 1, dtype=dt, device=dev)
    counts.scatter_add_(1, outs, torch.ones(outs.shape, dtype=dt, device=dev))
    counts = counts[:, :vocab]
    scalars = staging.to_device("pen_scalars", np.array(
        [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params],
        dtype=np.float32).reshape(n, 3)).to(dt)
    rep, freq, pres = (scalars[:, i:i + 1] for i in range(3))
    logits = logits.clone()
    if any(p.repetition_penalty != 1.0 for p in params):
        prompts = staging.to_device("pen_prompt", _padded(
            [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else [] for r in rows],
            vocab))
        seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=dev)
        seen.scatter_(1, prompts, True)
        seen = seen[:, :vocab] | (counts > 0)
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen & (rep != 1.0), penalized, logits)
    if any(p.frequency_penalty for p in params):
        logits = torch.where(freq != 0.0, logits - freq * counts, logits)
    if any(p.presence_penalty for p in params):
        logits = torch.where(pres != 0.0, logits - pres * (counts > 0).to(dt), logits)
    return logits


def block_stops(logits: torch.Tensor, rows: list[SamplingRow], vocab: int,
                staging: HostStaging) -> torch.Tensor:
    """Below min_tokens, EOS and stop tokens cannot be sampled: one scatter of -inf."""
    coords: list[tuple[int, int]] = []
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) >= p.min_tokens:
            continue
        stops = set(p.stop_token_ids)
        if not p.ignore_eos:
            stops |= p.eos_token_ids
        coords += [(i, t) for t in stops if t < vocab]
    logits = logits.clone()
    if coords:
        idx = staging.to_device("stops", np.array(coords, dtype=np.int64).T.copy())
        logits[idx[0], idx[1]] = float("-inf")
    return logits


def results(tokens: torch.Tensor, raw: torch.Tensor | None,
            params: list[SamplingParams]) -> tuple[list[int], list[Logprob | None]]:
    """The step's tokens and the logprobs of the rows that asked (top ids and values, the
    sampled token's rank and logprob), computed on the device and copied to the host in
    one transfer."""
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None] if raw is not None \
        else []
    if not wanted:
        return tokens.tolist(), [None] * len(params)
    k = max(params[i].logprobs for i in wanted)
    idx = torch.tensor(wanted, device=tokens.device)
    sub = raw[idx]
    lp = sub.gather(1, tokens[idx].unsqueeze(1))
    rank = (sub > lp).sum(dim=1, keepdim=True) + 1
    cols = [tokens.unsqueeze(1).to(torch.float64)]
    parts = [lp.to(torch.float64), rank.to(torch.float64)]
    if k:
        top = torch.topk(sub, k)
        parts += [top.indices.to(torch.float64), top.values.to(torch.float64)]
    packed = torch.cat(parts, dim=1)
    # One copy: [N] tokens then the wanted rows' [2 + 2k] numbers (float64 holds token ids
    # and ranks exactly, and every float32 logprob).
    host = torch.cat([cols[0].flatten(), packed.flatten()]).tolist()
    n = len(params)
    token_list = [int(t) for t in host[:n]]
    width = 2 + 2 * k
    out: list[Logprob | None] = [None] * n
    for j, i in enumerate(wanted):
        row = host[n + j * width:n + (j + 1) * width]
        m = params[i].logprobs
        ids = [int(x) for x in row[2:2 + m]]
        vals = row[2 + k:2 + k + m]
        out[i] = (ids, vals, int(row[1]), row[0])
    return token_list, out
