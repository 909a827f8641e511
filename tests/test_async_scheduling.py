"""Async scheduling (``--async-scheduling``): step n+1 is scheduled while step n runs, and
the tokens are those of synchronous scheduling: greedy equal to transformers' under every
policy with preemption, chunked prefill and prefix hits; seeded sampling unchanged; with
speculative decoding (whose steps stay synchronous); with aborts while a step is in
flight; and no placeholder ever outlives its step."""

from __future__ import annotations

import asyncio

import pytest
from test_exactness import check_exact, mixed_batch
from test_policies_exactness import POLICY_OPTIONS, POOLS, workload

from conveyor import LLM, SamplingParams
from conveyor.core.placeholders import PLACEHOLDER

from helpers import make_checkpoint, random_prompts
from test_async_engine import (
    EngineStepError,
    collect,
    greedy,
    offline_greedy_case,
    pool_is_back,
    running,
)


def _run(llm: LLM, prompts, params, sched=None, abort_at: int | None = None):
    """Steps the engine on a virtual clock (the policies' deadlines independent of the
    machine's speed), checking the scheduler's invariants after every step."""
    engine = llm.engine
    now = [0.0]
    engine.clock = lambda: now[0]
    results = {}

    def step() -> None:
        now[0] += 0.005
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        core = engine.core
        core.scheduler.check_invariants()
        for req in core.scheduler.requests.values():  # placeholders only while in flight
            inflight = core.async_steps is not None and core.async_steps.inflight
            assert PLACEHOLDER not in req.output_token_ids or inflight

    for i in range(len(prompts)):
        engine.add_request({"prompt_token_ids": prompts[i]}, params[i], request_id=str(i),
                           **(sched[i] if sched else {}))
        if i % 2 == 1:
            step()
        if abort_at is not None and i == abort_at:
            for out in engine.abort_request(["0"]):
                results[out.request_id] = out
    while engine.has_unfinished_requests():
        step()
    return results


@pytest.mark.parametrize("pool", ["preempt", "chunked"])
@pytest.mark.parametrize("policy", list(POLICY_OPTIONS))
def test_async_scheduling_never_changes_tokens(policy: str, pool: str) -> None:
    path = make_checkpoint("llama")
    llm = LLM(path, dtype="float32", scheduling_policy=policy, async_scheduling=True,
              **POLICY_OPTIONS[policy], **POOLS[pool])
    prompts, params, sched = workload()
    results = _run(llm, prompts, params, sched)
    check_exact(path, [results[str(i)] for i in range(len(prompts))], prompts, params)
    stats = llm.stats()
    assert stats["kv_blocks_in_use"] == 0, "every block must come back"
    assert llm.engine.core.async_steps.num_overlapped > stats["num_steps"] // 2
    if pool == "preempt":
        assert stats["num_preemptions"] > 0


def test_seeded_sampling_is_the_same_with_async_scheduling() -> None:
    path = make_checkpoint("llama")
    prompts, _ = mixed_batch(n=8, seed=4)
    params = [SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=100 + i)
              for i in range(len(prompts))]
    got = {}
    for mode in (False, True):
        llm = LLM(path, dtype="float32", async_scheduling=mode, num_kv_blocks=12,
                  block_size=8)  # preemptions too
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        got[mode] = [o.outputs[0].token_ids for o in outs]
    assert got[True] == got[False]


def test_speculative_steps_stay_synchronous_and_exact() -> None:
    path = make_checkpoint("llama")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    llm = LLM(path, dtype="float32", async_scheduling=True, speculative_config=spec)
    prompts, params = mixed_batch(n=8, seed=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    check_exact(path, outs, prompts, params)
    assert llm.engine.core.async_steps.num_overlapped == 0


def test_an_abort_while_a_step_is_in_flight() -> None:
    path = make_checkpoint("llama")
    llm = LLM(path, dtype="float32", async_scheduling=True, max_num_batched_tokens=16)
    prompts, params = mixed_batch(n=8, seed=6)
    results = _run(llm, prompts, params, abort_at=5)
    assert results["0"].finished
    rest = [str(i) for i in range(1, len(prompts))]
    check_exact(path, [results[r] for r in rest], prompts[1:], params[1:])
    assert llm.stats()["kv_blocks_in_use"] == 0


def test_streams_through_the_engine_loop_equal_offline_greedy() -> None:
    """The server's path (AsyncEngine's engine loop) with async scheduling: concurrent
    streams get the offline synchronous engine's tokens."""
    prompts, lengths, want = offline_greedy_case()

    async def main() -> list[list[int]]:
        async with running(async_scheduling=True) as engine:
            return await asyncio.gather(*(
                collect(engine, f"r{i}", p, greedy(n)) for i, (p, n) in
                enumerate(zip(prompts, lengths))))

    assert asyncio.run(main()) == want


def test_a_failing_step_with_one_in_flight_fails_its_requests_and_the_loop_goes_on() -> None:
    async def main() -> None:
        async with running(async_scheduling=True) as engine:
            free_at_start = await engine.call(lambda e: e.kv.num_free_blocks)
            executor = engine.core.executor
            real_execute = executor.execute_model
            calls = 0

            def execute(sched_out):
                nonlocal calls
                calls += 1
                if calls == 4:
                    raise RuntimeError("injected fault")
                return real_execute(sched_out)

            executor.execute_model = execute  # (the step thread calls it by name)
            results = await asyncio.wait_for(asyncio.gather(*(
                collect(engine, f"r{i}", p, greedy(40, ignore_eos=True))
                for i, p in enumerate(random_prompts(3))), return_exceptions=True), 60)
            assert any(isinstance(r, EngineStepError) for r in results), results
            for _ in range(200):
                if await pool_is_back(engine, free_at_start):
                    break
                await asyncio.sleep(0.05)
            assert await pool_is_back(engine, free_at_start)
            assert engine.is_alive and engine.core.num_step_errors == 1
            # New requests are served as before, with steps in flight again.
            assert len(await collect(engine, "after", random_prompts(1)[0],
                                     greedy(5, ignore_eos=True))) == 5

    asyncio.run(main())
