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
position, verified by equality (spec/verify.py), so its output is exactly its output
without speculation.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from conveyor.config import CacheConfig, ModelConfig, load_model_config
from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.model.attention import AttentionMetadata
from conveyor.sampling_params import SamplingParams
from conveyor.spec.config import SpeculativeConfig
from conveyor.spec.proposers import ProposeItem, Proposer

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
                 device: torch.device, attention_backend: str = "auto") -> None:
        from conveyor.runner.model_runner import ModelRunner  # (it imports this module)

        draft = load_model_config(config.model, dtype=target.dtype, seed=target.seed)
        draft = _with_compute_dtype(draft, target.math_dtype)
        check_shared_tokenizer(target, draft)
        self.config = draft
        # Its linears are chosen at one row: a draft runs decode rows of the few requests
        # it pays for (at 32 rows oneDNN won and took 27 us a call at one row, 3x
        # torch's).
        self.runner = ModelRunner(draft, cache, device, attention_backend,
                                  linear_rows=(1, 1))
        self._states: dict[str, _DraftState] = {}
        self._generator = torch.Generator(device=device).manual_seed(target.seed + 1)
        # Request -> [k, V] proposal probabilities of the last drafts (random requests).
        self.last_probs: dict[str, torch.Tensor] = {}

    @property
    def kv_bytes_per_token(self) -> int:
        return self.config.kv_bytes_per_token

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def finish(self, req_id: str) -> None:
        self._states.pop(req_id, None)

    def propose_batch(self, items: list[ProposeItem]) -> dict[str, list[int]]:
        """One forward per draft position, called on the model directly: the catch-up
        forward's inputs come from the runner's ``_prepare``; every later position's
        inputs are built once for all of them and advanced in place (the previous
        position's argmax is the next input, on the device), so the drafts reach the host
        in one copy at the end (a random request's draw reads its row each position)."""
        from conveyor.runner.model_runner import RequestState

        runner = self.runner
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
            # The target's token list is read in place (no copy): nothing appends to it
            # while the draft runs.
            runner.requests[it.req_id] = RequestState(it.req_id, tokens, [], _GREEDY,
                                                      it.block_ids, valid)
            first[it.req_id] = n - valid
        try:
            rounds = self._forward_all(items, first, random_rows, qs)
        finally:
            for it in items:
                runner.requests.pop(it.req_id, None)
        flat = torch.cat(rounds).tolist() if len(rounds) > 1 else rounds[0].tolist()
        out: dict[str, list[int]] = {it.req_id: [] for it in items}
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

    @torch.inference_mode()
    def _forward_all(self, items: list[ProposeItem], first: dict[str, int],
                     random_rows: list[int], qs: dict[str, list[torch.Tensor]]
                     ) -> list[torch.Tensor]:
        """The draft tokens of every position: a list of [rows drafting at r] tensors."""
        runner, model, device = self.runner, self.runner.model, self.runner.device
        caches = runner.kv_caches
        # Position 0: the catch-up forward. A short catch-up (the token or two the last
        # step added) is decode rows, each attending up to itself, as the target verifies
        # drafts (runner._prepare's draft rows): a prefill segment would build a mask and
        # take SDPA for two tokens. Decode rows first, as the runner orders them.
        rows = {it.req_id: it.token_ids[len(it.token_ids) - first[it.req_id] + 1:]
                for it in items if 1 < first[it.req_id] <= self.DECODE_ROWS_CATCH_UP}
        order = sorted(first, key=lambda rid: first[rid] != 1 and rid not in rows)
        sched = SchedulerOutput(num_scheduled_tokens=first,
                                total_num_scheduled_tokens=sum(first.values()),
                                sampling_req_ids=set(first),
                                scheduled_spec_tokens={r: list(t) for r, t in rows.items()})
        input_ids, positions, meta, logits_rows = runner._prepare(order, sched)
        hidden = model(input_ids, positions, meta, caches)
        row_of = {rid: row for row, rid in logits_rows}  # (the last row of each)
        idx = [row_of[it.req_id] for it in items]
        if idx != list(range(hidden.shape[0])):
            hidden = hidden[torch.tensor(idx, device=device)]
        tok = self._next(model.compute_logits(hidden), items, random_rows, 0, qs)
        rounds = [tok]
        longest = items[0].k
        if longest <= 1:
            return rounds
        # Positions 1..longest-1, all decode rows: row i feeds its draft r at position
        # n_i + r - 1 and attends to n_i + r tokens. Inputs for every position at once.
        bs = runner.block_size
        lens0 = np.array([len(it.token_ids) for it in items], dtype=np.int64)
        ks = np.array([it.k for it in items], dtype=np.int64)
        max_ctx = int((lens0 + ks - 1).max())
        bt = np.zeros((len(items), -(-max_ctx // bs)), dtype=np.int64)
        for i, it in enumerate(items):
            t = it.block_ids[:bt.shape[1]]
            bt[i, :len(t)] = t
        cols = np.arange(max_ctx, dtype=np.int64)
        slots = np.ascontiguousarray(bt[:, cols // bs] * bs + cols % bs)
        # Where each position's K/V goes: [longest - 1, rows] (rows past their k unused).
        pos_all = lens0[None, :] + np.arange(longest - 1, dtype=np.int64)[:, None]
        pos_all = np.minimum(pos_all, max_ctx - 1)
        write = np.take_along_axis(slots, pos_all.T, axis=1).T.copy()
        slots_t = torch.from_numpy(slots).to(device)
        write_t = torch.from_numpy(write).to(device)
        pos_t = torch.from_numpy(pos_all).to(device)
        lens_t = torch.from_numpy(lens0.astype(np.int32)).to(device)
        cols_t = torch.from_numpy(cols).to(device)
        window = runner.sliding_window
        kernel = runner.decode_kernel
        for r in range(1, longest):
            m = int((ks > r).sum())
            lens = lens_t[:m] + r
            starts = ((lens - window).clamp_min_(0) if window is not None
                      else torch.zeros_like(lens))
            meta = AttentionMetadata(slot_mapping=write_t[r - 1, :m], num_decodes=m,
                                     decode_slots=slots_t[:m], decode_lens=lens,
                                     decode_starts=starts, decode_kernel=kernel,
                                     prefill_kernel=runner.prefill_kernel)
            if kernel.needs_mask:
                meta.decode_mask = ((cols_t[None, :] < lens[:, None])
                                    & (cols_t[None, :] >= starts[:, None]))
            hidden = model(tok[:m], pos_t[r - 1, :m], meta, caches)
            tok = self._next(model.compute_logits(hidden), items[:m],
                             [i for i in random_rows if i < m], r, qs)
            rounds.append(tok)
        return rounds

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
        (spec/verify.py)."""
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


def _with_compute_dtype(cfg: ModelConfig, math_dtype: str) -> ModelConfig:
    import dataclasses

    if cfg.math_dtype == math_dtype:
        return cfg
    return dataclasses.replace(cfg, compute_dtype=math_dtype)
