"""Requests waiting for their grammar (core/grammar_gate.py): a constrained request is not
scheduled until the executor reports its compile done, while everyone else steps; a
failed compile fails that request alone. Scheduler-level with a fake runner (no torch),
then through the engine with a compile held back on purpose (a test double of the
compiler) on the random byte-level model."""

from __future__ import annotations

import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.core.grammar_gate import GRAMMAR_FAILED
from conveyor.request import RequestStatus
from conveyor.sampling_params import SamplingParams
from conveyor.structured_outputs import StructuredOutputsParams as SO

from helpers import fake_execute, make_request, make_scheduler

REGEX = SO(regex=r"[a-z]{3}")


def constrained(rid: str, prompt_len: int = 6, max_tokens: int = 3):
    req = make_request(rid, prompt_len, max_tokens)
    req.sampling_params = SamplingParams(max_tokens=max_tokens, structured_outputs=REGEX)
    return req


def step(sched, now: float, ready=(), errors=None) -> tuple:
    out = sched.schedule(now)
    run = fake_execute(out)
    run.grammars_ready, run.grammar_errors = list(ready), dict(errors or {})
    updates = sched.update(out, run, now)
    sched.check_invariants()
    return out, updates


def test_a_constrained_request_waits_outside_the_batch_until_its_grammar_is_ready() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("free", 6, 5), 0.0)
    sched.add_request(constrained("c"), 0.0)
    sched.add_request(constrained("c2"), 0.0)  # the same constraint: one compile
    assert sched.requests["c"].status == RequestStatus.WAITING_FOR_GRAMMAR
    out, _ = step(sched, 0.0)
    assert out.grammar_compiles == {REGEX.key(): REGEX}
    assert set(out.num_scheduled_tokens) == {"free"}
    for t in range(1, 4):  # the compile runs on: "free" steps, nothing is ordered again
        out, _ = step(sched, float(t))
        assert out.grammar_compiles == {} and set(out.num_scheduled_tokens) == {"free"}
    assert "c" not in sched.kv.req_blocks
    step(sched, 4.0, ready=[REGEX.key()])  # reported with a step's output
    assert sched.requests["c"].status == RequestStatus.WAITING
    out, _ = step(sched, 5.0)
    assert {"c", "c2"} <= set(out.num_scheduled_tokens)
    # Compiled now: a new request with it is admitted at once, in the next step.
    sched.add_request(constrained("c3"), 6.0)
    assert sched.requests["c3"].status == RequestStatus.WAITING
    out, _ = step(sched, 6.0)
    assert "c3" in out.num_scheduled_tokens and out.grammar_compiles == {}


def test_a_failed_compile_finishes_only_its_requests_with_the_reason() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("free", 6, 5), 0.0)
    sched.add_request(constrained("bad"), 0.0)
    step(sched, 0.0)
    out, updates = step(sched, 1.0, errors={REGEX.key(): "structured_outputs.regex: boom"})
    failed = [u for u in updates if u.request_id == "bad"]
    assert failed and failed[0].status == RequestStatus.FINISHED_ABORTED
    assert failed[0].stop_reason == f"{GRAMMAR_FAILED}: structured_outputs.regex: boom"
    assert "bad" not in sched.requests
    out, _ = step(sched, 2.0)
    assert out.grammar_evictions == [REGEX.key()]  # the runner forgets the failure
    assert "free" in out.num_scheduled_tokens
    sched.add_request(constrained("again"), 3.0)  # the same constraint: compiled anew
    out, _ = step(sched, 3.0)
    assert out.grammar_compiles == {REGEX.key(): REGEX}


def test_an_abort_while_waiting_for_the_grammar_leaves_the_others() -> None:
    sched = make_scheduler()
    sched.add_request(constrained("gone"), 0.0)
    sched.add_request(constrained("kept"), 0.0)
    step(sched, 0.0)
    sched.finish_requests("gone", RequestStatus.FINISHED_ABORTED)
    step(sched, 1.0, ready=[REGEX.key()])
    out, _ = step(sched, 2.0)
    assert set(out.num_scheduled_tokens) == {"kept"}


def test_the_runner_keeps_a_grammar_while_a_request_uses_it() -> None:
    from conveyor.core.grammar_gate import GrammarGate

    gate = GrammarGate(capacity=1)
    reqs = {}
    for i, rid in enumerate(["a", "b"]):
        reqs[rid] = make_request(rid, 4, 2)
        reqs[rid].sampling_params = SamplingParams(
            max_tokens=2, structured_outputs=SO(regex=f"[a-z]{{{i + 1}}}"))
        assert gate.hold(reqs[rid])
    keys = list(gate.take_orders()[0])
    gate.settle(keys, {})
    assert gate.take_orders()[1] == []  # over capacity, but both in use
    gate.finished("a")
    gate.settle([], {})
    assert gate.take_orders()[1] == [keys[0]]  # idle now: the least recently used goes
    again = make_request("b2", 4, 2)
    again.sampling_params = reqs["b"].sampling_params
    assert not gate.hold(again)  # still compiled: admitted at once


KEYS = [SO(regex=f"[a-z]{{{n}}}") for n in (1, 2, 3)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "add_c", "ready", "fail", "abort", "step"]),
                          st.integers(0, 7)), max_size=40))
def test_the_gate_keeps_the_scheduler_invariants(ops) -> None:
    sched = make_scheduler(num_blocks=16, max_num_seqs=4, max_num_batched_tokens=16)
    sched.grammar_gate.capacity = 1
    ready: list[str] = []
    errors: dict[str, str] = {}
    ordered: set[str] = set()
    now = 0.0
    for op, k in ops:
        rid = f"r{k}"
        key = KEYS[k % 3].key()
        if op in ("add", "add_c") and rid not in sched.requests:
            req = make_request(rid, 5, 3)
            if op == "add_c":
                req.sampling_params = SamplingParams(max_tokens=3,
                                                     structured_outputs=KEYS[k % 3])
            sched.add_request(req, now)
        elif op == "ready" and key in ordered:
            ready.append(key)
            ordered.discard(key)
        elif op == "fail" and key in ordered:
            errors[key] = "no"
            ordered.discard(key)
        elif op == "abort":
            sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        else:
            out, _ = step(sched, now, ready, errors)
            ordered |= set(out.grammar_compiles)
            ready, errors = [], {}
            now += 1.0
    # Whatever happened, everything still finishes once the compiles are reported.
    ordered |= set(ready) | set(errors)  # (reports not sent yet)
    for _ in range(200):
        if not sched.has_unfinished():
            break
        out, _ = step(sched, now, list(ordered))
        ordered = set(out.grammar_compiles)
        now += 1.0
    assert not sched.has_unfinished()


# ---- through the engine ------------------------------------------------------------------
def test_other_requests_step_while_a_compile_is_held_and_tokens_are_unchanged() -> None:
    from conveyor.config import EngineArgs
    from conveyor.engine.llm_engine import LLMEngine

    from structured_helpers import byte_checkpoint

    def engine():
        return LLMEngine(EngineArgs(model=byte_checkpoint(), dtype="float32",
                                    num_kv_blocks=64, block_size=16))

    slow = SO(regex=r"[a-c]{4}x")
    constrained_params = SamplingParams(temperature=1.0, seed=7, max_tokens=10,
                                        structured_outputs=slow)
    free_params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)

    def run(eng, gate_compile: threading.Event | None):
        grammars = eng.core.executor.runner.grammars
        if gate_compile is not None:  # the compiler's double: this grammar's compile waits
            real = grammars._compile

            def held_compile(params):
                if params == slow:
                    assert gate_compile.wait(60)
                return real(params)

            grammars._compile = held_compile
        eng.add_request("abc", constrained_params, request_id="c")
        eng.add_request("free", free_params, request_id="f")
        tokens: dict[str, list[int]] = {}
        steps_while_held = 0
        while eng.has_unfinished_requests():
            for out in eng.step():
                tokens[out.request_id] = list(out.outputs[0].token_ids)
            if gate_compile is not None and not gate_compile.is_set():
                steps_while_held += 1
                core = eng.core.scheduler.requests
                if core["f"].num_output_tokens >= 6:
                    # "f" stepped six times while "c" waited, holding no slot.
                    assert core["c"].status == RequestStatus.WAITING_FOR_GRAMMAR
                    assert core["c"].num_computed_tokens == 0
                    gate_compile.set()
        return tokens, grammars.num_waits, steps_while_held

    reference, _, _ = run(engine(), None)
    held = threading.Event()
    tokens, waited, steps = run(engine(), held)
    assert held.is_set() and steps >= 6
    assert waited == 0, "no step waited for a compile"
    assert tokens == reference  # the same tokens for both, whenever the grammar arrived
    assert len(tokens["f"]) == 12 and tokens["c"]


def test_a_compile_that_fails_fails_only_that_request() -> None:
    from conveyor.entrypoints.llm import LLM

    from structured_helpers import byte_checkpoint

    llm = LLM(byte_checkpoint(), dtype="float32", num_kv_blocks=64, block_size=16)
    grammars = llm.engine.core.executor.runner.grammars
    bad = SO(regex=r"[x-z]{2}")
    real = grammars._compile

    def failing_compile(params):
        if params == bad:
            raise ValueError("structured_outputs.regex: the double refused it")
        return real(params)

    grammars._compile = failing_compile
    outs = llm.generate(["one", "two", "three"], [
        SamplingParams(temperature=1.0, max_tokens=8, structured_outputs=bad),
        SamplingParams(temperature=1.0, max_tokens=8, structured_outputs=SO(choice=["ok"])),
        SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)])
    failed = outs[0].outputs[0]
    assert failed.finish_reason == "abort" and failed.token_ids == []
    assert failed.stop_reason == (f"{GRAMMAR_FAILED}: structured_outputs.regex: "
                                  "the double refused it")
    assert outs[1].outputs[0].text == "ok" and outs[1].outputs[0].finish_reason == "stop"
    assert len(outs[2].outputs[0].token_ids) == 8


def test_the_runner_reports_each_ordered_compile_once() -> None:
    from conveyor.runner.grammar import Grammars

    from structured_helpers import byte_checkpoint

    g = Grammars(byte_checkpoint(), 384, (2,))
    a, b = SO(choice=["x"]), SO(choice=["y"])
    g.order(a.key(), a)
    g.order(b.key(), b)
    ready: list[str] = []
    errors: dict[str, str] = {}
    while len(ready) + len(errors) < 2:
        g.report(ready, errors, wait_s=1.0)
    assert sorted(ready) == sorted([a.key(), b.key()]) and not errors
    again: list[str] = []
    g.report(again, errors)
    assert again == []
    g.add("r", a, [])  # the compiled grammar: no wait at its first fill
    g.fill([(0, "r")])
    assert g.num_waits == 0


def test_the_server_answers_a_failed_compile_with_a_400_giving_the_reason() -> None:
    import pytest

    from conveyor.entrypoints.openai.errors import OpenAIError
    from conveyor.entrypoints.openai.serving_common import check_not_aborted
    from conveyor.outputs import CompletionOutput, RequestOutput

    out = RequestOutput("r", None, [1], [CompletionOutput(
        0, "", [], finish_reason="abort",
        stop_reason=f"{GRAMMAR_FAILED}: structured_outputs.regex: too big")], True)
    with pytest.raises(OpenAIError) as e:
        check_not_aborted([out])
    assert e.value.status == 400 and e.value.code == GRAMMAR_FAILED
    assert "structured_outputs.regex: too big" in e.value.message


def test_prepare_imports_the_tokenizer_packages_on_the_callers_thread() -> None:
    """The background build of llguidance's tokenizer must find its packages imported: the
    engine loads its own tokenizer on the main thread meanwhile, and a package imported
    by two threads at once can fail in one of them ("partially initialized module")."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys, threading
        from conveyor.runner.grammar import Grammars
        assert "tokenizers" not in sys.modules, "imported before prepare: nothing to test"
        release = threading.Event()
        g = Grammars(None, 384, (2,))
        g._llg_tokenizer = release.wait  # the pool's build imports nothing itself
        g.prepare()
        print(sorted(m for m in ("tokenizers", "llguidance.hf") if m not in sys.modules))
        release.set()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
