"""The engine core alone, torch-free: typed requests in, typed outputs out, any executor.

A fake executor (a token per sampling request, a function of the request id and position)
stands in for the model; the clock is a counter. These check the core's contract: all
or nothing adds, aborts with a reason, outputs that carry what the front end's metrics
need, the messages' encoding across the process boundary, and stats that do not grow."""

from __future__ import annotations

import pytest

from conveyor.config import EngineArgs, resolve_engine_config
from conveyor.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from conveyor.engine.core import EngineCore
from conveyor.engine.messages import (
    AbortRequests,
    AddRequests,
    AddResult,
    CoreReady,
    EngineCoreOutputs,
    EngineCoreRequest,
    ErrorInfo,
    QueueFullError,
    StepOutputs,
    UtilityCall,
    UtilityMethod,
    command_decoder,
    core_message_decoder,
    encoder,
)
from conveyor.sampling_params import SamplingParams
from conveyor.sim.model import resolve_sim_model


class FakeExecutor:
    def __init__(self) -> None:
        self.seen: list[SchedulerOutput] = []

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.seen.append(out)
        result = ModelRunnerOutput()
        for rid in out.sampling_req_ids:  # exactly the scheduler's choice
            result.sampled_token_ids[rid] = [10 + len(rid) + out.num_scheduled_tokens[rid]]
        return result

    def shutdown(self) -> None:
        pass


class Counter:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def make_core(**kw) -> tuple[EngineCore, FakeExecutor]:
    args = EngineArgs(model="tiny", num_kv_blocks=kw.pop("num_kv_blocks", 32), block_size=4,
                      **kw)
    model = resolve_sim_model(args)
    config = resolve_engine_config(args, model, args.num_kv_blocks, "fake")
    executor = FakeExecutor()
    return EngineCore(config, executor, Counter()), executor


def req(rid: str, n_prompt: int = 5, max_tokens: int = 4, **kw) -> EngineCoreRequest:
    return EngineCoreRequest(rid, list(range(3, 3 + n_prompt)),
                             SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                            temperature=0.0), 0.0, **kw)


def run_to_end(core: EngineCore) -> dict[str, list]:
    outs: dict[str, list] = {}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_requests_run_to_their_length_and_outputs_carry_the_metrics_inputs() -> None:
    core, _ = make_core()
    core.add_requests([req("a"), req("b", max_tokens=2, priority=1, tenant="t")])
    outs = run_to_end(core)
    assert [len(o.new_token_ids) for o in outs["a"]] == [1, 1, 1, 1]
    last = outs["a"][-1]
    assert last.finish_reason == "length" and last.finished_time is not None
    assert last.first_scheduled_time is not None and last.num_preemptions == 0
    assert outs["b"][-1].finish_reason == "length" and len(outs["b"]) == 2
    assert all(o.finish_reason is None for o in outs["a"][:-1])
    assert core.kv.num_free_blocks == core.kv.num_blocks
    stats = core.stats()
    assert stats["generation_tokens"] == 6 and stats["num_finished"] == 2


def test_adds_are_all_or_none() -> None:
    core, _ = make_core(max_queue_len=2)
    with pytest.raises(QueueFullError):
        core.add_requests([req("a#0"), req("a#1"), req("a#2")])
    assert not core.has_unfinished_requests()
    with pytest.raises(ValueError, match="outside"):
        core.add_requests([req("x"), EngineCoreRequest("y", [10 ** 6], SamplingParams(), 0.0)])
    assert not core.has_unfinished_requests()
    core.add_requests([req("a")])
    with pytest.raises(ValueError, match="already in use"):
        core.add_requests([req("a")])
    with pytest.raises(ValueError, match="tenant"):
        core.add_requests([req("t", tenant="")])


def test_abort_with_a_reason_frees_blocks_and_reports_the_end() -> None:
    core, _ = make_core()
    core.add_requests([req("a", max_tokens=50), req("b", max_tokens=50)])
    core.step()
    core.step()
    finals = core.abort_requests(["a", "nope"], reason="stop", stop_reason="STOP")
    assert [(o.request_id, o.finish_reason, o.stop_reason) for o in finals] == \
        [("a", "stop", "STOP")]
    finals = core.abort_requests(["b"])
    assert finals[0].finish_reason == "abort" and finals[0].finished_time is not None
    assert core.kv.num_free_blocks == core.kv.num_blocks and not core.has_unfinished_requests()


def test_the_executor_samples_exactly_the_scheduler_s_choice() -> None:
    core, executor = make_core(max_num_batched_tokens=4)  # prompts of 9 take 3 chunks
    core.add_requests([req("a", n_prompt=9, max_tokens=2)])
    outs = run_to_end(core)
    chunks = [o for o in executor.seen if o.num_scheduled_tokens]
    assert [o.sampling_req_ids for o in chunks] == [set(), set(), {"a"}, {"a"}]
    assert sum(len(o.new_token_ids) for o in outs["a"]) == 2


def test_stats_hold_aggregates_only() -> None:
    core, _ = make_core()
    for i in range(30):
        core.add_requests([req(f"r{i}", max_tokens=3)])
        run_to_end(core)
    s = core.scheduler.stats
    assert not any(isinstance(v, list | dict) for v in vars(s).values())
    assert s.num_batched_rows >= 30 * 3 and s.last_step_batch_size == 1


def test_typed_messages_round_trip_and_carry_no_callables() -> None:
    enc = encoder()
    sp = SamplingParams(max_tokens=3, stop=["x"], seed=5, eos_token_ids=frozenset({2}))
    cmds = [AddRequests([EngineCoreRequest("a", [1, 2], sp, 1.5, 2, "t", 100.0)]),
            AbortRequests(["a"], "stop", "x"), UtilityCall(7, UtilityMethod.STATS)]
    back = command_decoder().decode(enc.encode(cmds))
    assert back[0].requests[0].sampling_params == sp and back[1:] == cmds[1:]
    core, _ = make_core()
    outs = EngineCoreOutputs([], 3.0)
    dec = core_message_decoder()
    for msg in (CoreReady(core.config), StepOutputs(outs),
                AddResult("a", ErrorInfo.of(QueueFullError("full")))):
        assert dec.decode(enc.encode(msg)) == msg
    assert isinstance(ErrorInfo.of(QueueFullError("q")).rebuild(), QueueFullError)
    assert type(ErrorInfo.of(ValueError("v")).rebuild()) is ValueError
    with pytest.raises(TypeError):
        enc.encode(UtilityCall(1, lambda: 0))  # type: ignore[arg-type]
