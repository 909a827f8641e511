"""--reasoning-parser: <think>...</think> apart from the answer, whole and streamed (every
split point agrees with the whole parse); over HTTP, reasoning_content beside content,
and a constrained request left whole (its grammar applies from the first token)."""

from __future__ import annotations

import itertools
import json

import httpx
import pytest

from conveyor.entrypoints.openai.reasoning import ReasoningStream, split_reasoning

from server_helpers import ServerProcess, serve
from structured_helpers import byte_checkpoint

CASES = [
    ("deepseek_r1", "<think>\nLet me see: 2+2.\n</think>\n\nIt is 4.", "\nLet me see: 2+2.\n",
     "It is 4."),
    ("deepseek_r1", "Let me see.</think>It is 4.", "Let me see.", "It is 4."),
    ("deepseek_r1", "Still thinking, no end", "Still thinking, no end", ""),
    ("qwen3", "<think>a < b</think>\n\nYes.", "a < b", "Yes."),
    ("qwen3", "No thinking here: <think> later is content", "",
     "No thinking here: <think> later is content"),
    ("qwen3", "<think>cut off", "cut off", ""),
]


@pytest.mark.parametrize("parser, text, reasoning, content", CASES)
def test_whole_and_streamed_agree(parser: str, text: str, reasoning: str,
                                  content: str) -> None:
    assert split_reasoning(parser, text, final=True) == (reasoning, content)
    for cuts in [list(range(1, len(text))), *[[c] for c in range(1, len(text))]]:
        stream, got_r, pieces = ReasoningStream(parser), "", []
        bounds = [0, *cuts, len(text)]
        for i in range(1, len(bounds)):
            delta, answer = stream.update(text[:bounds[i]], final=i == len(bounds) - 1)
            got_r += delta
            pieces.append(answer)
        assert got_r == reasoning
        assert pieces[-1] == content
        # the content so far only ever grows (what was streamed stays true)
        assert all(b.startswith(a) for a, b in itertools.pairwise(pieces))
        # nothing of a tag leaks into the reasoning sent so far
        assert "<think" not in got_r and "</" not in got_r.replace("a < b", "")


@pytest.fixture(scope="module")
def server():
    with serve(byte_checkpoint(), "--served-model-name", "m",
               "--reasoning-parser", "deepseek_r1") as s:
        yield s


def chat(server: ServerProcess, **body) -> httpx.Response:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "m", "messages": [{"role": "user", "content": "think"}], **body})
    assert r.status_code == 200, r.text
    return r


def test_the_server_puts_thinking_apart(server: ServerProcess) -> None:
    # A random model never closes the block: with deepseek_r1 it is all reasoning.
    whole = chat(server, max_tokens=12, temperature=0, ignore_eos=True).json()
    msg = whole["choices"][0]["message"]
    assert msg["reasoning_content"] and not msg["content"]
    r = chat(server, max_tokens=12, temperature=0, ignore_eos=True, stream=True)
    got = ""
    for e in r.text.split("\n\n"):
        if e.startswith("data: ") and "[DONE]" not in e:
            for c in json.loads(e[6:])["choices"]:
                got += c["delta"].get("reasoning_content") or ""
                assert not c["delta"].get("content")
    assert got == msg["reasoning_content"]


SCHEMA = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"],
          "additionalProperties": False}


def test_a_constraint_applies_after_the_reasoning() -> None:
    """The wrapped grammar: any text up to the first </think>, then the constraint."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    from conveyor.structured_outputs import StructuredOutputsParams as SO

    hf = AutoTokenizer.from_pretrained(byte_checkpoint())
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=[2])

    def takes(params: SO, text: str) -> bool:
        m = llguidance.LLMatcher(tok, params.grammar_text())
        ids = hf.encode(text, add_special_tokens=False)
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) \
            and m.is_accepting()

    json_after = SO(json=SCHEMA, after_reasoning=True)
    assert takes(json_after, '<think>maybe {"a": 3}?</think>\n\n{"a":1}')
    assert takes(json_after, 'no opening tag</think>{"a":2}')
    assert not takes(json_after, '{"a":1}')  # the answer must follow the reasoning
    assert not takes(json_after, '<think>a</think>b</think>{"a":1}')  # the first one ends it
    assert not takes(json_after, '<think>a</think>{"a":3}')
    assert takes(SO(regex="[a-z]{2}/[0-9]", after_reasoning=True), "hm</think>\nab/1")
    assert takes(SO(choice=["yes", "no"], after_reasoning=True), "hm</think>no")
    with pytest.raises(ValueError, match="cannot follow a reasoning block"):
        SO(grammar='start: "a"', after_reasoning=True).grammar_text()


def test_a_constrained_request_thinks_first(server: ServerProcess) -> None:
    # A random model never writes </think>: all of its output is reasoning, no answer yet.
    r = chat(server, max_tokens=30, temperature=1.0, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["reasoning_content"] and not choice["message"]["content"]
    bad = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "m", "messages": [{"role": "user", "content": "x"}],
        "structured_outputs": {"grammar": 'start: "a"'}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "structured_outputs"


@pytest.mark.parametrize("prompt, state", [
    ("<|im_start|>assistant\n", "none"),
    ("<|im_start|>assistant\n<think>\n", "open"),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "closed"),
    # a past turn's block is history: the new turn is the model's to decide
    ("<think>a</think>b<|im_end|>\n<|im_start|>assistant\n", "none"),
])
def test_how_the_prompt_leaves_the_think_block(prompt: str, state: str) -> None:
    from conveyor.entrypoints.openai.reasoning import prompt_thinking

    assert prompt_thinking(prompt) == state


def test_with_qwen3_the_block_is_optional_and_the_answer_may_come_first() -> None:
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    from conveyor.structured_outputs import StructuredOutputsParams as SO

    hf = AutoTokenizer.from_pretrained(byte_checkpoint())
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=[2])
    optional = SO(json=SCHEMA, after_reasoning=True, reasoning_optional=True)
    m0 = llguidance.LLMatcher(tok, optional.grammar_text())

    def takes(text: str) -> bool:
        m = m0.deep_copy()
        ids = hf.encode(text, add_special_tokens=False)
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) \
            and m.is_accepting()

    assert takes('{"a":1}')  # no block: constrained from the first token
    assert takes('<think>hm {"a": 3}</think>\n{"a":2}')
    assert not takes('hm</think>{"a":1}')  # a block must open with <think>
    assert not takes('{"a":3}')
    assert optional.key() != SO(json=SCHEMA, after_reasoning=True).key()


# Qwen3's switch: with enable_thinking false the generation prompt closes an empty block.
QWEN3_LIKE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_qwen3_with_thinking_off_constrains_the_answer_from_the_start() -> None:
    with serve(byte_checkpoint(), "--served-model-name", "m", "--reasoning-parser", "qwen3",
               "--chat-template", QWEN3_LIKE) as s:
        for seed in range(3):
            msg = chat(s, max_tokens=40, temperature=1.0, seed=seed,
                       chat_template_kwargs={"enable_thinking": False},
                       response_format={"type": "json_schema",
                                        "json_schema": {"name": "x", "schema": SCHEMA}}
                       ).json()["choices"][0]
            assert msg["finish_reason"] == "stop", msg
            assert json.loads(msg["message"]["content"])["a"] in (1, 2)
            assert not msg["message"].get("reasoning_content")
