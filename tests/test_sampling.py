"""Sampling parameters end to end: seeds, penalties, stops, logprobs, n > 1."""

from __future__ import annotations

import math

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.runner.sampler import Sampler, SamplingRow

from helpers import hf_greedy, hf_model, make_checkpoint, random_prompts


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(make_checkpoint("llama"), dtype="float32", max_num_batched_tokens=64)


def ids(p):
    return {"prompt_token_ids": p}


def test_seeded_sampling_is_independent_of_the_batch(llm: LLM) -> None:
    prompts = random_prompts(6, seed=11)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    alone = llm.generate([ids(prompts[0])], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=n, temperature=0.8) for n in (3, 20, 7, 15, 9)]
    mixed = llm.generate([ids(p) for p in prompts], [seeded, *others])
    assert mixed[0].outputs[0].token_ids == alone
    # A different seed gives a different stream (with overwhelming probability).
    other_seed = llm.generate([ids(prompts[0])], seeded.clone(seed=99))[0]
    assert other_seed.outputs[0].token_ids != alone


def test_seeded_sampling_survives_preemption() -> None:
    path = make_checkpoint("llama")
    prompts = random_prompts(8, lo=20, hi=40, seed=4)
    params = [SamplingParams(max_tokens=16, temperature=1.0, seed=i) for i in range(8)]
    roomy = LLM(path, dtype="float32").generate([ids(p) for p in prompts], params)
    tight = LLM(path, dtype="float32", num_kv_blocks=10, block_size=8)
    cramped = tight.generate([ids(p) for p in prompts], params)
    assert tight.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in cramped] == [o.outputs[0].token_ids for o in roomy]


def test_top_k_1_and_tiny_top_p_are_greedy(llm: LLM) -> None:
    prompts = random_prompts(3, seed=2)
    greedy = llm.generate([ids(p) for p in prompts], SamplingParams(max_tokens=8, temperature=0))
    for params in (SamplingParams(max_tokens=8, temperature=1.5, top_k=1),
                   SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-6)):
        outs = llm.generate([ids(p) for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outs] == \
               [o.outputs[0].token_ids for o in greedy]


def test_sampling_distribution_matches_softmax() -> None:
    """The exponential race samples from softmax(logits / T): check frequencies."""
    sampler = Sampler(vocab_size=4, device=torch.device("cpu"), seed=0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    rows = [SamplingRow(SamplingParams(temperature=0.7), [1], []) for _ in range(4000)]
    tokens = torch.tensor(sampler(logits, rows).token_ids)
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    want = torch.softmax(logits[0] / 0.7, dim=-1)
    assert torch.allclose(freq, want, atol=0.03), (freq, want)


def test_top_k_and_min_p_restrict_support() -> None:
    sampler = Sampler(vocab_size=5, device=torch.device("cpu"), seed=0)
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -5.0]]).repeat(500, 1)
    rows = [SamplingRow(SamplingParams(temperature=5.0, top_k=2), [1], []) for _ in range(500)]
    assert set(sampler(logits, rows).token_ids) == {0, 1}
    rows = [SamplingRow(SamplingParams(temperature=1.0, min_p=0.5), [1], []) for _ in range(500)]
    # p(3)/p(0) = e^-3 < 0.5 and p(4) smaller still: only tokens 0..2 survive.
    assert set(sampler(logits, rows).token_ids) <= {0, 1, 2}


def test_repetition_penalty_matches_transformers() -> None:
    path = make_checkpoint("llama")
    prompt = random_prompts(1, lo=12, hi=12, seed=8)[0]
    llm = LLM(path, dtype="float32")
    got = llm.generate([ids(prompt)], SamplingParams(max_tokens=10, temperature=0,
                                                     repetition_penalty=1.7))[0]
    model = hf_model(path)
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                              repetition_penalty=1.7, pad_token_id=0,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert got.outputs[0].token_ids == want[0, len(prompt):].tolist()


def test_presence_and_frequency_penalties_follow_their_formula() -> None:
    sampler = Sampler(vocab_size=4, device=torch.device("cpu"))
    logits = torch.tensor([[1.0, 0.9, 0.8, 0.0]])
    # token 0 appeared twice, token 1 once
    row = SamplingRow(SamplingParams(temperature=0, frequency_penalty=0.2,
                                     presence_penalty=0.05), [3], [0, 0, 1])
    # adjusted: 1.0 - 0.4 - 0.05 = 0.55, 0.9 - 0.2 - 0.05 = 0.65, 0.8 -> token 2 wins
    assert sampler(logits, [row]).token_ids == [2]
    row = SamplingRow(SamplingParams(temperature=0, frequency_penalty=0.05), [3], [0, 0, 1])
    assert sampler(logits, [row]).token_ids == [0]  # 0.9 > 0.85 > 0.8


def test_stop_token_ids_min_tokens_and_ignore_eos(llm: LLM) -> None:
    prompt = random_prompts(1, seed=21)[0]
    free = llm.generate([ids(prompt)], SamplingParams(max_tokens=12, temperature=0))[0]
    tokens = free.outputs[0].token_ids
    stop_at = tokens[4]
    first = tokens.index(stop_at)
    out = llm.generate([ids(prompt)], SamplingParams(max_tokens=12, temperature=0,
                                                     stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids == tokens[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    # min_tokens masks the stop token until enough tokens exist.
    out = llm.generate([ids(prompt)], SamplingParams(max_tokens=12, temperature=0,
                                                     stop_token_ids=[stop_at],
                                                     min_tokens=first + 2))[0].outputs[0]
    assert len(out.token_ids) >= first + 2
    assert stop_at not in out.token_ids[:first + 2]


def test_eos_stops_unless_ignored() -> None:
    path = make_checkpoint("llama")
    llm = LLM(path, dtype="float32")
    prompt = random_prompts(1, seed=3)[0]
    first = hf_greedy(path, prompt, 1)[0]
    # Make the first greedy token the EOS: generation stops right there.
    llm.engine.core.eos_token_ids = frozenset({first})
    out = llm.generate([ids(prompt)], SamplingParams(max_tokens=5, temperature=0))[0]
    assert out.outputs[0].token_ids == [first] and out.outputs[0].finish_reason == "stop"
    out = llm.generate([ids(prompt)], SamplingParams(max_tokens=5, temperature=0,
                                                     ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


def test_stop_strings_are_cut_from_the_text(llm: LLM) -> None:
    prompt = "ba be bi bo"
    free = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0))[0].outputs[0]
    words = free.text.split()
    assert len(words) >= 4
    stop = words[2]
    out = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0,
                                                stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and free.text.startswith(out.text)
    kept = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, stop=[stop],
                                                 include_stop_str_in_output=True))[0]
    assert kept.outputs[0].text.endswith(stop)


def test_logprobs_match_log_softmax() -> None:
    path = make_checkpoint("qwen2")
    llm = LLM(path, dtype="float32")
    prompt = random_prompts(1, seed=9)[0]
    out = llm.generate([ids(prompt)], SamplingParams(max_tokens=3, temperature=0,
                                                     logprobs=3))[0].outputs[0]
    model = hf_model(path)
    seq = list(prompt)
    for token, entry in zip(out.token_ids, out.logprobs):
        with torch.no_grad():
            want = torch.log_softmax(model(torch.tensor([seq])).logits[0, -1], dim=-1)
        top = torch.topk(want, 3)
        assert set(entry) == set(top.indices.tolist()) | {token}
        for tid, lp in entry.items():
            assert math.isclose(lp.logprob, want[tid].item(), abs_tol=1e-4)
        assert entry[token].rank == 1  # greedy picks the top token
        seq.append(token)
    assert math.isclose(out.cumulative_logprob, sum(e[t].logprob for t, e in
                                                    zip(out.token_ids, out.logprobs)))


def test_n_samples_share_a_prompt(llm: LLM) -> None:
    prompt = random_prompts(1, seed=12)[0]
    out = llm.generate([ids(prompt)], SamplingParams(n=3, max_tokens=6, temperature=1.0,
                                                     seed=5))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate([ids(prompt)], SamplingParams(n=3, max_tokens=6, temperature=1.0,
                                                       seed=5))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_output_order_matches_input_order(llm: LLM) -> None:
    prompts = random_prompts(7, seed=13)
    params = [SamplingParams(max_tokens=20 - 2 * i, temperature=0, ignore_eos=True)
              for i in range(7)]
    outs = llm.generate([ids(p) for p in prompts], params)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [20 - 2 * i for i in range(7)]
    m = outs[0].metrics
    assert m.first_token_time >= m.arrival_time and m.finished_time >= m.first_token_time
    assert m.queue_time is not None and m.num_generation_tokens == 20
