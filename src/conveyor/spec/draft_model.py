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

import torch

from conveyor.config import CacheConfig, ModelConfig, load_model_config
from conveyor.core.scheduler_output import SchedulerOutput
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

    def __init__(self, config: SpeculativeConfig, target: ModelConfig, cache: CacheConfig,
                 device: torch.device, attention_backend: str = "auto") -> None:
        from conveyor.runner.model_runner import ModelRunner  # (it imports this module)

        draft = load_model_config(config.model, dtype=target.dtype, seed=target.seed)
        draft = _with_compute_dtype(draft, target.math_dtype)
        check_shared_tokenizer(target, draft)
        self.config = draft
        self.runner = ModelRunner(draft, cache, device, attention_backend)
        self.runner.record_logits = True  # q for random requests comes from these
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
        runner = self.runner
        from conveyor.runner.model_runner import RequestState

        self.last_probs = {}
        random_items = [it for it in items if it.params is not None and not it.params.greedy]
        qs: dict[str, list[torch.Tensor]] = {it.req_id: [] for it in random_items}

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
        self._run(first)
        self._draw(random_items, 0, qs)
        longest = max(it.k for it in items)
        for r in range(1, longest):
            step = {}
            for it in items:
                if it.k > r:
                    state = runner.requests[it.req_id]
                    state.num_computed_tokens = len(it.token_ids) + r - 1
                    step[it.req_id] = 1
            self._run(step)
            self._draw([it for it in random_items if it.k > r], r, qs)
        out = {}
        for it in items:
            drafts = runner.requests.pop(it.req_id).output_token_ids[:it.k]
            st = self._states[it.req_id]
            st.real_len, st.fed = len(it.token_ids), drafts[:-1]
            out[it.req_id] = drafts
            if qs.get(it.req_id):
                self.last_probs[it.req_id] = torch.stack(qs[it.req_id][:len(drafts)])
        return out

    def _draw(self, items: list[ProposeItem], r: int, qs: dict[str, list[torch.Tensor]]
              ) -> None:
        """Replace the argmax the draft runner appended (draft ``r``) by a draw from ``q``,
        the draft's distribution under the request's own sampling parameters. A seeded
        request's draw is coupled to the target's: the exponential race with the noise
        the target's sampler uses at that output position (spec/verify.py)."""
        if not items:
            return
        runner = self.runner
        logits = torch.stack([runner.last_logits[it.req_id] for it in items])
        params = [it.params for it in items]
        raw = runner.sampler.probs(logits, params, [False] * len(items))
        probs = raw / raw.sum(dim=-1, keepdim=True)  # min-p leaves rows unnormalized
        for i, it in enumerate(items):
            if it.params.seed is not None:
                # The draft's position in the request's output: the noise of (seed, it).
                position = len(it.token_ids) - it.num_prompt_tokens + r
                noise = runner.sampler.seeded_noise(it.params.seed, position,
                                                    torch.empty_like(raw[i]))
                tok = int((raw[i] / noise).argmax())
            else:
                tok = int(torch.multinomial(probs[i], 1, generator=self._generator))
            state = runner.requests[it.req_id]
            state.output_token_ids[-1] = tok
            if state.all_token_ids is not None:
                state.all_token_ids[-1] = tok
            qs[it.req_id].append(probs[i])


    def _run(self, scheduled: dict[str, int]) -> None:
        if scheduled:
            self.runner.execute(SchedulerOutput(
                num_scheduled_tokens=scheduled,
                total_num_scheduled_tokens=sum(scheduled.values()),
                sampling_req_ids=set(scheduled)))


def _with_compute_dtype(cfg: ModelConfig, math_dtype: str) -> ModelConfig:
    import dataclasses

    if cfg.math_dtype == math_dtype:
        return cfg
    return dataclasses.replace(cfg, compute_dtype=math_dtype)
