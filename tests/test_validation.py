"""Bad input fails alone, with a message that says what is wrong, before any work starts."""

from __future__ import annotations

import pytest

from conveyor import LLM, SamplingParams

from helpers import make_checkpoint, random_prompts


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(make_checkpoint("llama"), dtype="float32", num_kv_blocks=40, block_size=8)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(n=0), "n"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_fail_before_any_work(llm: LLM) -> None:
    good = {"prompt_token_ids": random_prompts(1)[0]}
    steps = llm.stats()["num_steps"]
    cases = [
        ({"prompt_token_ids": []}, "empty"),
        ({"prompt_token_ids": [1, 2, 99999]}, "outside"),
        ({"prompt_token_ids": [5] * 400}, "max_model_len"),  # pool holds 320 tokens
        ("", "empty"),
    ]
    for bad, msg in cases:
        with pytest.raises(ValueError, match=msg):
            llm.generate([good, bad], SamplingParams(max_tokens=4))
    assert llm.stats()["num_steps"] == steps, "nothing may run when any prompt is bad"
    assert not llm.engine.has_unfinished_requests()


def test_max_model_len_is_capped_by_the_pool(llm: LLM) -> None:
    assert llm.engine.max_model_len == 40 * 8


def test_engine_keeps_serving_after_a_rejected_request(llm: LLM) -> None:
    with pytest.raises(ValueError):
        llm.engine.add_request({"prompt_token_ids": [10**6]}, SamplingParams())
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3,
                                                                         ignore_eos=True))
    assert len(outs[0].outputs[0].token_ids) == 3


def test_long_generation_is_capped_at_max_model_len(llm: LLM) -> None:
    prompt = [7] * 300
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=100, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length"
    assert len(prompt) + len(out.token_ids) == llm.engine.max_model_len


def test_unknown_options_and_policy_are_errors() -> None:
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM("tiny", max_num_seq=3)
    with pytest.raises(ValueError, match="fcfs"):
        LLM("tiny", scheduling_policy="nope")
    with pytest.raises(ValueError, match="neither a folder nor a built-in"):
        LLM("/no/such/model")


def test_per_prompt_params_length_must_match(llm: LLM) -> None:
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        llm.generate([[5], [6], [7]], [SamplingParams(), SamplingParams()])


def test_offline_batch_larger_than_the_queue_limit_completes() -> None:
    """Admission control caps the waiting queue; the offline API feeds it as it drains."""
    llm = LLM("tiny", max_queue_len=3, max_num_seqs=2)
    outs = llm.generate([[5 + i, 6] for i in range(9)],
                        SamplingParams(max_tokens=3, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [3] * 9
    assert llm.stats()["peak_waiting"] <= 3
