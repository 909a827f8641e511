"""Structured outputs in the engine: a random-weight model with a byte-level tokenizer,
sampled at temperature 1 (so no structure comes from the model), writes outputs that
match their JSON schema, regex, choice or grammar every time: batched with free-text
requests, with n = 2, under preemption, with speculative decoding on; the strict JSON
parser (no raw control characters in strings) is the judge. Bad constraints are a
ValueError naming the field."""

from __future__ import annotations

import re

import jsonschema
import pytest

from conveyor.entrypoints.llm import LLM
from conveyor.sampling_params import SamplingParams
from conveyor.structured_outputs import StructuredOutputsParams as SO

from structured_helpers import byte_checkpoint, strict_json

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}(\.[0-9])?"
CHOICE = ["red", "green", "deep blue"]
GRAMMAR = 'start: "(" expr ")"\nexpr: NUM | NUM "+" NUM\nNUM: /[0-9]{1,2}/'
MAX_TOKENS = 160  # room for the longest output the constraints allow


def check(kind: str, text: str) -> None:
    """``text`` is valid for the constraint of ``kind`` (the assertion names it)."""
    if kind == "json":
        jsonschema.validate(strict_json(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(strict_json(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICE, text
    else:
        assert re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})?\)", text), text


CONSTRAINTS = {"json": SO(json=SCHEMA), "regex": SO(regex=REGEX), "choice": SO(choice=CHOICE),
               "grammar": SO(grammar=GRAMMAR)}


def params(kind: str, seed: int | None = None, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=seed, n=n,
                          structured_outputs=CONSTRAINTS[kind])


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(byte_checkpoint(), dtype="float32", num_kv_blocks=128, block_size=16)


def run_all(llm: LLM, n: int = 1) -> None:
    prompts = [f"prompt {i}: say it" for i in range(10)]
    kinds = [list(CONSTRAINTS)[i % len(CONSTRAINTS)] for i in range(len(prompts))]
    # Free-text requests ride in the same batch: they must stay unconstrained.
    free = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(prompts + ["free text"], [params(k, n=n) for k in kinds] + [free])
    for kind, out in zip(kinds, outs):
        assert len(out.outputs) == n
        for c in out.outputs:
            assert c.finish_reason == "stop", (kind, c.text)
            check(kind, c.text)
    assert len(outs[-1].outputs[0].token_ids) == 20


def test_every_output_matches_its_constraint(llm: LLM) -> None:
    run_all(llm)


def test_with_n_2_each_sample_keeps_its_own_matcher(llm: LLM) -> None:
    run_all(llm, n=2)


def test_json_object_and_whitespace_flexible_json() -> None:
    llm = LLM(byte_checkpoint(), dtype="float32", num_kv_blocks=128)
    # Any JSON object may nest without end under a random model: its outputs are strict
    # JSON when they stop, and a prefix the grammar accepts when they run out of tokens.
    outs = llm.generate([f"p{i}" for i in range(6)], SamplingParams(
        temperature=1.0, max_tokens=MAX_TOKENS, structured_outputs=SO(json_object=True)))
    stopped = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    for text in stopped:
        assert isinstance(strict_json(text), dict)
    for o in outs:
        assert o.outputs[0].text.startswith("{")
    flex = llm.generate(["p"] * 4, SamplingParams(
        temperature=1.0, max_tokens=MAX_TOKENS,
        structured_outputs=SO(json={"type": "object", "properties": {"x": {"enum": [1, 2]}},
                                    "required": ["x"], "additionalProperties": False},
                              whitespace_flexible=True)))
    for o in flex:
        if o.outputs[0].finish_reason == "stop":
            assert strict_json(o.outputs[0].text)["x"] in (1, 2)


def test_seeded_constrained_samples_do_not_depend_on_the_batch(llm: LLM) -> None:
    alone = llm.generate(["the same"], params("json", seed=5))[0].outputs[0].text
    crowd = llm.generate(["other", "the same", "more"],
                         [params("regex", seed=1), params("json", seed=5),
                          params("choice", seed=2)])
    assert crowd[1].outputs[0].text == alone


def test_under_preemption() -> None:
    # 14 blocks of 8 tokens for 6 requests of ~25 prompt tokens and up to ~70 more: they
    # preempt each other, and a preempted request's matcher replays its output so far.
    llm = LLM(byte_checkpoint(), dtype="float32", num_kv_blocks=14, block_size=8,
              max_num_seqs=6)
    kinds = ["json", "regex", "grammar", "json", "choice", "json"]
    outs = llm.generate([f"a longer prompt, number {i}, so that blocks run out" for i in range(6)],
                        [params(k, seed=i) for i, k in enumerate(kinds)])
    assert llm.stats()["num_preemptions"] > 0
    for kind, out in zip(kinds, outs):
        assert out.outputs[0].finish_reason == "stop"
        check(kind, out.outputs[0].text)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_with_speculative_decoding_on(method: str) -> None:
    # Drafts are checked against the grammar: each draft position's row is masked after
    # the drafts before it, a refused draft is rejected, the matcher rolls back and then
    # advances on what verification kept. Free text rides along and still speculates.
    llm = LLM(byte_checkpoint(), dtype="float32", num_kv_blocks=128, speculative_config={
        "method": method, "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "adaptive": False})
    kinds = ["json", "regex", "choice", "grammar", "json", "json"]
    prompt = '{"name":"ab","age":1,"tags":["a"],"ok":true} '  # JSON to copy drafts from
    free = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([prompt * 2 + str(i) for i in range(len(kinds))] + ["ab ab ab ab"],
                        [params(k, seed=i) for i, k in enumerate(kinds)] + [free])
    for kind, out in zip(kinds, outs):
        assert out.outputs[0].finish_reason == "stop"
        check(kind, out.outputs[0].text)
    assert len(outs[-1].outputs[0].token_ids) == 40
    # Constrained requests alone: their drafts were verified, some kept.
    before = llm.stats()["spec_decode"]["num_accepted_tokens"]
    outs = llm.generate([prompt * 2] * 4, [params("json", seed=10 + i) for i in range(4)])
    for out in outs:
        check("json", out.outputs[0].text)
    assert llm.stats()["spec_decode"]["num_accepted_tokens"] > before


@pytest.mark.parametrize("fields, named", [
    (dict(json={"type": "object", "if": {"required": ["a"]}}), "if"),
    (dict(json={"type": "string", "format": "no-such-format"}), "no-such-format"),
    (dict(regex="[a-"), "regex"),
    (dict(grammar="start: undefined_rule"), "undefined_rule"),
    (dict(json="{not json"), "json"),
])
def test_a_constraint_the_engine_cannot_honour_is_refused_naming_it(
        llm: LLM, fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=re.escape(named)):
        llm.generate(["x"], SamplingParams(structured_outputs=SO(**fields)))


@pytest.mark.parametrize("fields, named", [
    (dict(), "exactly one"),
    (dict(regex="a", choice=["b"]), "exactly one"),
    (dict(choice=[]), "non-empty list"),
    (dict(structural_tag="{}"), "structural_tag.triggers"),
    (dict(structural_tag={"triggers": ["<f"], "structures": [
        {"begin": "<g>", "schema": {}, "end": ""}]}), r"structures\[0\]\.begin"),
    (dict(structural_tag={"format": {}}), "only the 'structures' \\+ 'triggers' form"),
])
def test_malformed_params_are_refused(fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        SO(**fields)


@pytest.mark.parametrize("field", ["ignore_eos", "min_tokens"])
def test_fields_a_grammar_cannot_honour_with_it_are_refused(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(structured_outputs=SO(regex="a"), **{field: {"ignore_eos": True,
                                                                   "min_tokens": 2}[field]})


def test_a_tokenizer_the_grammar_engine_cannot_read_is_refused_at_add() -> None:
    # The synthetic WordPiece tokenizer has no byte form of its tokens: refused before any
    # step, instead of failing the step (and its batch-mates) later.
    from helpers import make_checkpoint

    llm = LLM(make_checkpoint("llama"), dtype="float32", num_kv_blocks=32)
    with pytest.raises(ValueError, match="structured_outputs are not supported here"):
        llm.generate(["ba"], SamplingParams(structured_outputs=SO(choice=["ba"])))
    assert llm.generate(["ba"], SamplingParams(max_tokens=3, ignore_eos=True)
                        )[0].outputs[0].token_ids


# A trigger the byte-level model writes often (its BPE was learnt on JSON): every quote
# must open a structure.
STRUCTURAL_TAG = {"triggers": ['"'], "structures": [
    {"begin": '"x=', "schema": {"enum": [1, 2]}, "end": '"'}]}


def test_a_structural_tag_holds_every_structure_its_triggers_open(llm: LLM) -> None:
    outs = llm.generate([f"tag {i}:" for i in range(8)], [SamplingParams(
        temperature=1.0, max_tokens=40, seed=seed,
        structured_outputs=SO(structural_tag=STRUCTURAL_TAG)) for seed in range(8)])
    texts = [o.outputs[0].text for o in outs]
    assert sum(t.count('"x=') for t in texts) >= 2, texts  # the triggers did fire
    for out, text in zip(outs, texts):
        if out.outputs[0].finish_reason == "length":  # a structure may be cut off
            text = re.sub(r'"(x(=([12]"?)?)?)?$', "", text)
        assert re.fullmatch(r'[^"]*("x=[12]"[^"]*)*', text), text
