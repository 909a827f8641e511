"""Prompt logprobs against transformers' log-softmax (chunked prefill, prefix hits,
preemption, batch mixes), their bounded memory, and logit_bias in the sampler."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor import LLM, SamplingParams
from conveyor.request import Request
from conveyor.runner.prompt_logprobs import PromptSpan, compute_prompt_logprobs
from conveyor.runner.sampler import Sampler, SamplingRow

from helpers import hf_model, make_checkpoint, random_prompts

# Both sides compute in float32 from the same weights; the kernels differ in summation
# order only: a few ulps of logits of magnitude ~10 (~1e-6 each), so 1e-5 is above the
# rounding and far below any real error (a wrong position or token is off by ~1).
ATOL = 1e-5


@pytest.fixture(scope="module")
def path() -> str:
    return make_checkpoint("llama")


@pytest.fixture(scope="module")
def reference(path: str):
    model = hf_model(path)

    def logprobs(prompt: list[int]) -> torch.Tensor:
        """[P - 1, vocab]: row i scores prompt token i + 1."""
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)[:-1]

    return logprobs


def ids(p: list[int]) -> dict:
    return {"prompt_token_ids": p}


def check_against(reference, prompt: list[int], got, k: int) -> None:
    """``got``: a RequestOutput's prompt_logprobs."""
    assert got is not None and len(got) == len(prompt) and got[0] is None
    if len(prompt) == 1:
        return
    ref = reference(prompt)
    for i, entry in enumerate(got[1:]):
        token = prompt[i + 1]
        row = ref[i]
        assert entry[token].rank == int((row > row[token]).sum()) + 1, (i, token)
        top = torch.topk(row, k).indices.tolist() if k else []
        assert set(entry) == set(top) | {token}
        for tid, lp in entry.items():
            assert abs(lp.logprob - row[tid].item()) <= ATOL, (i, tid)
        for r, tid in enumerate(top):
            assert entry[tid].rank == r + 1


def test_prompt_logprobs_equal_transformers_across_chunks_and_batch_mixes(path, reference) -> None:
    # A 16-token budget splits most prompts into chunks, several requests per step.
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16, enable_prefix_caching=False)
    prompts = [[7], [7, 9], *random_prompts(6, lo=3, hi=60, seed=5)]
    ks = [0, 3, None, 1, 5, None, 2, 0]
    params = [SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=k) for k in ks]
    outs = llm.generate([ids(p) for p in prompts], params)
    for prompt, k, out in zip(prompts, ks, outs):
        if k is None:
            assert out.prompt_logprobs is None
        else:
            check_against(reference, prompt, out.prompt_logprobs, k)
    # Asking changes no token: the same requests without prompt logprobs.
    plain = llm.generate([ids(p) for p in prompts], SamplingParams(max_tokens=4, temperature=0))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_a_prefix_hit_does_not_skip_prompt_logprobs(path, reference) -> None:
    llm = LLM(path, dtype="float32", block_size=8, enable_prefix_caching=True)
    prompt = random_prompts(1, lo=40, hi=41, seed=8)[0]
    greedy = SamplingParams(max_tokens=2, temperature=0)
    llm.generate([ids(prompt)], greedy)  # its blocks are cached now
    asked = llm.generate([ids(prompt)], greedy.clone(prompt_logprobs=2))[0]
    assert asked.num_cached_tokens == 0  # computed, not read from the cache
    check_against(reference, prompt, asked.prompt_logprobs, 2)
    # Its blocks serve later requests that do not ask.
    assert llm.generate([ids(prompt)], greedy)[0].num_cached_tokens == 32  # 4 full blocks


def test_prompt_logprobs_survive_preemption(path, reference) -> None:
    prompts = random_prompts(8, lo=20, hi=40, seed=4)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=2)
    tight = LLM(path, dtype="float32", num_kv_blocks=10, block_size=8,
                max_num_batched_tokens=16)
    outs = tight.generate([ids(p) for p in prompts], params)
    assert tight.stats()["num_preemptions"] > 0
    for prompt, out in zip(prompts, outs):
        check_against(reference, prompt, out.prompt_logprobs, 2)


def test_n_samples_share_one_prompt_logprobs(path, reference) -> None:
    llm = LLM(path, dtype="float32")
    prompt = random_prompts(1, lo=12, hi=13, seed=2)[0]
    out = llm.generate([ids(prompt)], SamplingParams(n=3, max_tokens=3, temperature=1.0,
                                                     seed=1, prompt_logprobs=1))[0]
    assert len(out.outputs) == 3
    check_against(reference, prompt, out.prompt_logprobs, 1)


def test_only_top_k_rows_leave_and_logits_come_in_bounded_slices() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(50, 8)
    head = torch.randn(32, 8)
    widest = []

    def logits(h: torch.Tensor) -> torch.Tensor:
        widest.append(h.shape[0])
        return h @ head.T

    spans = [PromptSpan("a", 0, 1, list(range(1, 21)), 3), PromptSpan("b", 25, 4,
                                                                      [5] * 20, 0)]
    out = compute_prompt_logprobs(hidden, spans, logits, slice_rows=7)
    assert max(widest) <= 7 and sum(widest) == 40
    ref = torch.log_softmax(hidden @ head.T, dim=-1)
    first, entries = out["a"]
    assert first == 1 and len(entries) == 20
    for i, (top_ids, top_vals, rank, lp) in enumerate(entries):
        top = torch.topk(ref[i], 3)
        assert top_ids == top.indices.tolist()
        assert top_vals == pytest.approx(top.values.tolist(), abs=1e-6)
        assert lp == pytest.approx(ref[i, i + 1].item(), abs=1e-6)
        assert rank == int((ref[i] > ref[i, i + 1]).sum()) + 1
    first, entries = out["b"]
    assert first == 4 and all(e[0] == [] and e[1] == [] for e in entries)
    assert entries[0][3] == pytest.approx(ref[25, 5].item(), abs=1e-6)


# ---- logit_bias --------------------------------------------------------------------------
def _rows(params: list[SamplingParams]) -> list[SamplingRow]:
    return [SamplingRow(p, [1, 2], []) for p in params]


def test_logit_bias_forces_and_bans_under_greedy_and_sampling() -> None:
    sampler = Sampler(vocab_size=6, device=torch.device("cpu"), seed=0)
    logits = torch.tensor([[5.0, 1.0, 0.0, 0.0, 0.0, 0.0]]).repeat(4, 1)
    params = [SamplingParams(temperature=0, logit_bias={3: 100}),
              SamplingParams(temperature=1.0, logit_bias={3: 100}),
              SamplingParams(temperature=0, logit_bias={0: -100}),
              SamplingParams(temperature=1.0)]
    for _ in range(50):
        tokens = sampler(logits, _rows(params)).token_ids
        assert tokens[0] == 3 and tokens[1] == 3 and tokens[2] == 1
    # Banned under sampling: never drawn, where it is drawn most of the time unbiased.
    banned = [SamplingParams(temperature=1.0, logit_bias={0: -100})] * 4
    drawn = [t for _ in range(50) for t in sampler(logits, _rows(banned)).token_ids]
    assert 0 not in drawn
    unbiased = [t for _ in range(50) for t in sampler(logits, _rows(params[3:] * 4)).token_ids]
    assert unbiased.count(0) > 100
    # The caller's logits are untouched (the bias goes into a new tensor).
    assert logits[0, 3].item() == 0.0


def test_logit_bias_end_to_end(path: str) -> None:
    llm = LLM(path, dtype="float32")
    prompt = random_prompts(1, lo=10, hi=11, seed=3)[0]
    forced = llm.generate([ids(prompt)], SamplingParams(max_tokens=6, temperature=0,
                                                        ignore_eos=True,
                                                        logit_bias={17: 100}))[0]
    assert forced.outputs[0].token_ids == [17] * 6
    plain = llm.generate([ids(prompt)], SamplingParams(max_tokens=6, temperature=0,
                                                       ignore_eos=True))[0].outputs[0].token_ids
    bias = {t: -100 for t in set(plain)}
    banned = llm.generate([ids(prompt)], SamplingParams(max_tokens=6, temperature=0.8, seed=2,
                                                        ignore_eos=True, logit_bias=bias))[0]
    assert not set(banned.outputs[0].token_ids) & set(plain)


@pytest.mark.parametrize("field, value", [("prompt_logprobs", 21), ("prompt_logprobs", -1),
                                          ("logit_bias", {3: 101}), ("logit_bias", {-1: 1})])
def test_out_of_range_values_name_the_field(field: str, value) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


# ---- the core's collection -----------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.integers(2, 40), st.lists(st.integers(1, 12), min_size=1, max_size=30),
       st.lists(st.integers(0, 39), max_size=4))
def test_the_request_collects_each_position_once(prompt_len: int, chunks: list[int],
                                                 restarts: list[int]) -> None:
    """Chunks of any size, recomputed from any earlier position after a preemption: every
    prompt token 1..P-1 is collected once, in order, and handed out once."""
    req = Request("r", list(range(prompt_len)), SamplingParams(prompt_logprobs=1), 0.0)
    pos, restarts = 0, list(restarts)
    for n in chunks * 4:
        if restarts and restarts[0] <= pos:  # a preemption: back to an earlier position
            pos = restarts.pop(0)
        end = min(pos + n, prompt_len - 1)
        if end > pos:
            req.add_prompt_logprobs(pos + 1, [([], [], 1, float(j))
                                              for j in range(pos + 1, end + 1)])
        pos = end
        if pos == prompt_len - 1:
            break
    if pos < prompt_len - 1:
        req.add_prompt_logprobs(pos + 1, [([], [], 1, float(j))
                                          for j in range(pos + 1, prompt_len)])
    assert not req.wants_prompt_logprobs
    req.append_output_token(0)
    assert [e[3] for e in req.take_prompt_logprobs()] == [float(j) for j in range(1, prompt_len)]
    req.append_output_token(0)
    assert req.take_prompt_logprobs() is None
