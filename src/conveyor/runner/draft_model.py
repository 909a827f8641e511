"""The ``draft_model`` proposer: a small Hugging Face checkpoint run by our own runner.

The draft has its own K/V tensors but no blocks of its own: it writes into the same
block ids as the target (the request's blocks, owned by the KV cache manager like any
other; each block simply holds the draft's layers too). The scheduler reserves the
lookahead slots its proposals write (``SpeculativeConfig.writes_draft_kv``).

Proposing for a request of ``L`` real tokens: one forward over the tokens whose draft
K/V is not valid yet (the prompt the first time, then the 1-2 tokens the last step
added) gives draft 1; each further draft is one single-token forward. Draft K/V of a
proposal that the target accepted stays valid, so the next catch-up starts after it.
For a greedy request the drafts are the draft's argmax (a one-hot proposal). For a
random one they are drawn from the draft's own distribution ``q`` (its logits through the
request's temperature, top-k, top-p and min-p, as the target's rows are), and ``q`` goes
with them (``last_probs``) so that verification accepts with ``min(1, p / q)``: more
drafts survive than argmax drafts would (a draft equal to the target: all of them), and
the output still follows the target. A seeded request's drafts are coupled to the
target's sampling instead: drawn with the noise the target's sampler uses at that
position, verified by equality (runner/verify.py), so its output is exactly its output
without speculation.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from conveyor import envs
from conveyor.config import CacheConfig, ModelConfig, SpeculativeConfig, load_model_config
from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.kernels.cpu.ops import DraftForward
from conveyor.model.attention.metadata import AttentionMetadata
from conveyor.runner.decode_layout import attended, padded_slots, window_starts
from conveyor.runner.request_state import RequestState
from conveyor.sampling_params import SamplingParams
from conveyor.spec.proposers import ProposeItem, Proposer

logger = logging.getLogger(__name__)
_GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


@dataclass
class _DraftState:
    real_len: int = 0  # real tokens when it last proposed (their draft K/V is valid)
    fed: list[int] = field(default_factory=list)  # drafts fed after them (K/V written)


def tokenizer_fingerprint(path: str | None) -> str | None:
    """The vocabulary (tokenizer.json's, else the raw tokenizer files), or None."""
    if path is None:
        return None
    tj = os.path.join(path, "tokenizer.json")
    if os.path.isfile(tj):
        with open(tj) as f:
            model = json.load(f).get("model", {})
        return json.dumps([model.get("type"), model.get("vocab"), model.get("merges")],
                          sort_keys=True)
    for name in ("tokenizer.model", "vocab.json"):
        p = os.path.join(path, name)
        if os.path.isfile(p):
            with open(p, "rb") as f:
                return f.read().hex()
    return None


def check_shared_tokenizer(target: ModelConfig, draft: ModelConfig) -> None:
    """A draft must speak the target's token ids: same vocabulary, same tokenizer."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model {draft.path!r} has a vocabulary of "
                         f"{draft.vocab_size} tokens, the target {target.vocab_size}: a "
                         "draft model must share the target's tokenizer")
    fa, fb = tokenizer_fingerprint(target.tokenizer), tokenizer_fingerprint(draft.tokenizer)
    if fa is not None and fb is not None and fa != fb:
        raise ValueError(f"speculative_config.model {draft.path!r} has another tokenizer "
                         f"than the target {target.path!r}: a draft model must share the "
                         "target's tokenizer")


class DraftModelProposer(Proposer):
    name = "draft_model"
    DECODE_ROWS_CATCH_UP = 8  # the longest catch-up run as decode rows

    def __init__(self, config: SpeculativeConfig, target: ModelConfig, cache: CacheConfig,
                 device: torch.device, attention_backend: str = "auto", *,
                 make_runner: Callable[..., Any]) -> None:
        """``make_runner``: the target's runner class (``ModelRunner``), which runs the
        draft too; given, not imported, since that runner builds this proposer."""
        draft = load_model_config(config.model, dtype=target.dtype, seed=target.seed)
        draft = _with_compute_dtype(draft, target.math_dtype)
        check_shared_tokenizer(target, draft)
        self.config = draft
        # Its linears are chosen at one row: a draft runs decode rows of the few requests
        # it pays for (a backend timed at 32 rows can be slow at one). Where its whole
        # proposal can run natively (draft_forward.c), they are the native GEMM's, which
        # that loop reads.
        native = native_draft_possible(draft, device)
        self.runner = make_runner(draft, cache, device, attention_backend,
                                  linear_backend="native" if native else "auto",
                                  linear_rows=(1, 1))
        if len(self.runner.layer_windows) > 1:  # its decode rows carry one window's starts
            raise ValueError(f"draft model {config.model!r}: per-layer sliding windows "
                             "(Gemma 2/3) are not supported in a draft model")
        self.native: DraftForward | None = None  # built with the KV caches
        self._native_wanted = native
        self._states: dict[str, _DraftState] = {}
        self._generator = torch.Generator(device=device).manual_seed(target.seed + 1)
        # Request -> [k, V] proposal probabilities of the last drafts (random requests).
        self.last_probs: dict[str, torch.Tensor] = {}

    @property
    def kv_bytes_per_token(self) -> int:
        return self.config.kv_bytes_per_token

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)
        self.native = None
        if self._native_wanted:
            try:
                self.native = DraftForward(self.runner.model, self.runner.kv_caches)
            except ValueError as e:  # the model does not fit the loop: PyTorch it is
                logger.info("draft model proposals through PyTorch: %s", e)

    def finish(self, req_id: str) -> None:
        self._states.pop(req_id, None)

    def propose_batch(self, items: list[ProposeItem]) -> dict[str, list[int]]:
        """One forward per draft position, called on the model directly, every one's
        inputs cut from one slot layout (``_DecodeLayout``); the previous position's
        argmax is the next input, on the device, so the drafts reach the host in one copy
        at the end (a random request's draw reads its row each position)."""
        self.last_probs = {}
        if not items:
            return {}
        # Longest drafts first: the rows still drafting at position r are a prefix.
        items = sorted(items, key=lambda it: -it.k)
        random_rows = [i for i, it in enumerate(items)
                       if it.params is not None and not it.params.greedy]
        qs: dict[str, list[torch.Tensor]] = {items[i].req_id: [] for i in random_rows}

        first: dict[str, int] = {}
        for it in items:
            st = self._states.setdefault(it.req_id, _DraftState())
            tokens = it.token_ids
            n = len(tokens)
            # Draft K/V is valid for the real tokens it saw, then for the fed drafts the
            # target accepted (they are real tokens now).
            valid = min(st.real_len, n)
            if valid == st.real_len:
                for j, d in enumerate(st.fed):
                    if valid >= n - 1 or tokens[st.real_len + j] != d:
                        break
                    valid += 1
            valid = min(valid, n - 1)  # the last real token is always fed: it gives draft 1
            first[it.req_id] = n - valid
        # Steady: each request caught up on the token or two the last step added (more:
        # it did not propose for a step or more, and pays for that now).
        self.last_steady = max(first.values()) <= 2
        if (self.native is not None and not random_rows
                and max(first.values()) <= self.DECODE_ROWS_CATCH_UP):
            out = self._propose_native(items, first)
        else:
            rounds = self._forward_all(items, first, random_rows, qs)
            flat = torch.cat(rounds).tolist() if len(rounds) > 1 else rounds[0].tolist()
            out = {it.req_id: [] for it in items}
            at = 0
            for r in range(len(rounds)):
                for it in items[:len(rounds[r])]:
                    out[it.req_id].append(flat[at])
                    at += 1
        for it in items:
            drafts = out[it.req_id]
            st = self._states[it.req_id]
            st.real_len, st.fed = len(it.token_ids), drafts[:-1]
            if qs.get(it.req_id):
                self.last_probs[it.req_id] = torch.stack(qs[it.req_id][:len(drafts)])
        return out

    def _propose_native(self, items: list[ProposeItem], first: dict[str, int]
                        ) -> dict[str, list[int]]:
        """Every draft of a greedy proposal in one native call (``draft_forward.c``): the
        same forwards as ``_forward_all``'s decode rows, with no Python between them."""
        catch = np.array([first[it.req_id] for it in items], dtype=np.int32)
        lens0 = np.array([len(it.token_ids) for it in items], dtype=np.int64)
        ks = np.array([it.k for it in items], dtype=np.int32)
        ids = np.array([t for it, c in zip(items, catch.tolist(), strict=True)
                        for t in it.token_ids[len(it.token_ids) - c:]], dtype=np.int64)
        max_ctx = int((lens0 + ks - 1).max())
        slots = padded_slots([it.block_ids for it in items], max_ctx, self.runner.block_size)
        drafts = self.native(ids, catch, lens0, ks, slots).tolist()
        return {it.req_id: row[:it.k] for it, row in zip(items, drafts, strict=True)}

    @torch.inference_mode()
    def _forward_all(self, items: list[ProposeItem], first: dict[str, int],
                     random_rows: list[int], qs: dict[str, list[torch.Tensor]]
                     ) -> list[torch.Tensor]:
        """The draft tokens of every position: a list of [rows drafting at r] tensors.

        Position 0 is the catch-up forward over the ``first[rid]`` tokens whose draft
        K/V is not valid yet; positions 1..k-1 feed the previous position's drafts. In the
        steady state (every catch-up a token or two) all of them are decode rows over one
        slot layout built once; a long catch-up (the prompt, on a request's first
        proposal) goes through the runner's ``_prepare`` as a prefill segment."""
        runner, model = self.runner, self.runner.model
        caches = runner.kv_caches
        lens0 = np.array([len(it.token_ids) for it in items], dtype=np.int64)
        ks = np.array([it.k for it in items], dtype=np.int64)
        catch = np.array([first[it.req_id] for it in items], dtype=np.int64)
        layout = _DecodeLayout(runner, items, lens0, ks)
        if int(catch.max()) <= self.DECODE_ROWS_CATCH_UP:
            hidden = self._catch_up_rows(items, lens0, catch, layout)
        else:
            hidden = self._catch_up_prepared(items, first)
        tok = self._next(model.compute_logits(hidden), items, random_rows, 0, qs)
        rounds = [tok]
        for r in range(1, int(ks[0])):
            # Row i feeds its draft r at position n_i + r - 1, attending to n_i + r
            # tokens; rows past their k dropped (items are longest first).
            m = int((ks > r).sum())
            meta = layout.meta(np.arange(m), lens0[:m] + (r - 1))
            hidden = model(tok[:m], layout.positions(lens0[:m] + (r - 1)),
                           meta, caches)
            tok = self._next(model.compute_logits(hidden), items[:m],
                             [i for i in random_rows if i < m], r, qs)
            rounds.append(tok)
        return rounds

    def _catch_up_rows(self, items: list[ProposeItem], lens0: np.ndarray, catch: np.ndarray,
                       layout: _DecodeLayout) -> torch.Tensor:
        """The catch-up as decode rows, each attending up to itself (as the target
        verifies drafts): [items] hidden states, each item's last row."""
        rows = np.repeat(np.arange(len(items)), catch)
        ends = np.cumsum(catch)
        pos = lens0[rows] + np.arange(int(ends[-1])) - ends[rows]  # n_i - c_i .. n_i - 1
        ids = [t for it, c in zip(items, catch.tolist(), strict=True)
               for t in it.token_ids[len(it.token_ids) - c:]]
        hidden = self.runner.model(torch.tensor(ids, dtype=torch.long, device=layout.device),
                                   layout.positions(pos), layout.meta(rows, pos),
                                   self.runner.kv_caches)
        last = ends - 1
        if len(last) != hidden.shape[0]:
            hidden = hidden[torch.from_numpy(last).to(layout.device)]
        return hidden

    def _catch_up_prepared(self, items: list[ProposeItem], first: dict[str, int]
                           ) -> torch.Tensor:
        """The catch-up through the runner's ``_prepare`` (a long one is a prefill
        segment; a short one among them decode rows, as the target verifies drafts)."""
        runner = self.runner
        rows = {it.req_id: it.token_ids[len(it.token_ids) - first[it.req_id] + 1:]
                for it in items if 1 < first[it.req_id] <= self.DECODE_ROWS_CATCH_UP}
        order = sorted(first, key=lambda rid: first[rid] != 1 and rid not in rows)
        sched = SchedulerOutput(num_scheduled_tokens=first,
                                total_num_scheduled_tokens=sum(first.values()),
                                sampling_req_ids=set(first),
                                scheduled_spec_tokens={r: list(t) for r, t in rows.items()})
        # ``_prepare`` reads the requests' states; the target's token lists are read in
        # place (no copy): nothing appends to them while the draft runs.
        for it in items:
            runner.requests[it.req_id] = RequestState(
                it.req_id, it.token_ids, [], _GREEDY, it.block_ids,
                len(it.token_ids) - first[it.req_id])
        try:
            input_ids, positions, meta, logits_rows = runner._prepare(order, sched)
        finally:
            for it in items:
                runner.requests.pop(it.req_id, None)
        hidden = runner.model(input_ids, positions, meta, runner.kv_caches)
        row_of = {rid: row for row, rid in logits_rows}  # (the last row of each)
        idx = [row_of[it.req_id] for it in items]
        if idx != list(range(hidden.shape[0])):
            hidden = hidden[torch.tensor(idx, device=runner.device)]
        return hidden

    def _next(self, logits: torch.Tensor, items: list[ProposeItem], random_rows: list[int],
              r: int, qs: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        """Draft ``r + 1`` of each row: the argmax, a random request's replaced by a draw
        (``_draw``)."""
        tok = logits.argmax(dim=-1)
        if random_rows:
            self._draw(logits, tok, [(i, items[i]) for i in random_rows], r, qs)
        return tok

    def _draw(self, logits: torch.Tensor, tok: torch.Tensor,
              rows: list[tuple[int, ProposeItem]], r: int,
              qs: dict[str, list[torch.Tensor]]) -> None:
        """Replace the argmax of each random request's row (its draft ``r + 1``) by a
        draw from ``q``, the draft's distribution under the request's own sampling
        parameters. A seeded request's draw is coupled to the target's: the exponential
        race with the noise the target's sampler uses at that output position
        (runner/verify.py)."""
        sampler = self.runner.sampler
        sel = torch.tensor([i for i, _ in rows], device=logits.device)
        raw = sampler.probs(logits[sel].float(), [it.params for _, it in rows],
                            [False] * len(rows))
        probs = raw / raw.sum(dim=-1, keepdim=True)  # min-p leaves rows unnormalized
        for j, (i, it) in enumerate(rows):
            if it.params.seed is not None:
                # The draft's position in the request's output: the noise of (seed, it).
                position = len(it.token_ids) - it.num_prompt_tokens + r
                noise = sampler.seeded_noise(it.params.seed, position,
                                             torch.empty_like(raw[j]))
                tok[i] = (raw[j] / noise).argmax()
            else:
                tok[i] = torch.multinomial(probs[j], 1, generator=self._generator)[0]
            qs[it.req_id].append(probs[j])


class _DecodeLayout:
    """Every drafting request's context slots, padded to the longest context a draft
    forward of this proposal attends to (the catch-up's and every later position's),
    built once per proposal; ``meta`` picks the rows of one forward from it."""

    def __init__(self, runner, items: list[ProposeItem], lens0: np.ndarray,
                 ks: np.ndarray) -> None:
        self.device = runner.device
        self.window = runner.sliding_window
        self.decode_kernel, self.prefill_kernel = runner.decode_kernel, runner.prefill_kernel
        max_ctx = int((lens0 + np.maximum(ks, 1) - 1).max())
        self.slots = padded_slots([it.block_ids for it in items], max_ctx, runner.block_size)
        self.slots_t = torch.from_numpy(self.slots).to(self.device)

    def positions(self, pos: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(pos)).to(self.device)

    def meta(self, rows: np.ndarray, pos: np.ndarray) -> AttentionMetadata:
        """Decode rows: row ``g`` is request ``rows[g]``'s token at ``pos[g]``, writing
        its K/V there and attending to every position up to it (its window's)."""
        lens = (pos + 1).astype(np.int32)
        starts = window_starts(lens, self.window)
        m = len(rows)
        prefix = m <= len(self.slots) and bool((rows == np.arange(m)).all())
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(self.slots[rows, pos]).to(self.device),
            num_decodes=m,
            decode_slots=(self.slots_t[:m] if prefix
                          else self.slots_t[torch.from_numpy(rows).to(self.device)]),
            decode_lens=torch.from_numpy(lens).to(self.device),
            decode_starts=torch.from_numpy(starts).to(self.device),
            decode_kernel=self.decode_kernel, prefill_kernel=self.prefill_kernel)
        if self.decode_kernel.needs_mask:
            meta.decode_mask = torch.from_numpy(
                attended(self.slots.shape[1], lens, starts)).to(self.device)
        return meta


def native_draft_possible(cfg: ModelConfig, device: torch.device) -> bool:
    """Whether a draft's greedy proposals may run as one native loop: a float32 model on
    a CPU where the native GEMM builds (the tables are checked when built; a model that
    does not fit stays on PyTorch), unless ``CONVEYOR_NATIVE_DRAFT=0``."""
    if not envs.switched_on(envs.NATIVE_DRAFT):
        return False
    if device.type != "cpu" or cfg.math_dtype != "float32" or cfg.dtype != "float32":
        return False
    from conveyor.kernels import cpu as kernels
    from conveyor.kernels.cpu import ops as native_ops

    return kernels.load() is not None and native_ops.gemm_available()


def _with_compute_dtype(cfg: ModelConfig, math_dtype: str) -> ModelConfig:
    import dataclasses

    if cfg.math_dtype == math_dtype:
        return cfg
    return dataclasses.replace(cfg, compute_dtype=math_dtype)
