"""The async engine: its loop keeps stepping while requests come and go; aborts, timeouts
and faults stay with the request they belong to, and every KV block comes back."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator

import pytest

from conveyor import LLM, SamplingParams
from conveyor.config import EngineArgs
from conveyor.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineStepError,
    QueueFullError,
    RequestTimeoutError,
)
from conveyor.engine.llm_engine import LLMEngine
from conveyor.outputs import RequestMetrics

from helpers import cpu_threads, gate_steps, make_checkpoint, random_prompts, steps_are_held
from server_helpers import ATTENTION_BACKEND


def engine_args(**overrides) -> EngineArgs:
    kw = dict(model=make_checkpoint("llama"), dtype="float32", num_threads=cpu_threads(),
              num_kv_blocks=64, block_size=8, attention_backend=ATTENTION_BACKEND)
    kw.update(overrides)
    return EngineArgs(**kw)


@contextlib.asynccontextmanager
async def running(**overrides) -> AsyncIterator[AsyncEngine]:
    engine = AsyncEngine(LLMEngine(engine_args(**overrides)))
    engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


async def wait_until(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def gate(engine: AsyncEngine, steps: int | None = None, until=None) -> None:
    """``gate_steps`` on the engine loop: from now on only ``steps`` more steps run
    (None: any number), or steps until ``until(engine)`` holds. Deterministic whatever
    the machine's speed: a held engine serves commands but moves no request."""
    await engine.call(functools.partial(gate_steps, steps=steps, until=until))


async def held(engine: AsyncEngine) -> bool:
    return await engine.call(steps_are_held)


async def pool_is_back(engine: AsyncEngine, free_at_start: int) -> bool:
    def check(e: LLMEngine) -> bool:
        e.scheduler.check_invariants()
        return e.kv.num_free_blocks == free_at_start and not e.has_unfinished_requests()

    return await engine.call(check)


async def collect(engine: AsyncEngine, rid: str, prompt, params, **kw) -> list[int]:
    tokens: list[int] = []
    async for out in engine.generate(rid, prompt, params, **kw):
        tokens.extend(out.outputs[0].token_ids)
    return tokens


def offline_greedy_case() -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Six prompts, their greedy output lengths, and the offline engine's tokens for them."""
    prompts = random_prompts(6, lo=3, hi=40, seed=1)
    lengths = [5, 9, 1, 14, 7, 11]
    offline = LLM(engine_args().model, dtype="float32", num_threads=cpu_threads(),
                  attention_backend=ATTENTION_BACKEND)
    want = [o.outputs[0].token_ids for o in offline.generate(
        [{"prompt_token_ids": p} for p in prompts], [greedy(n) for n in lengths])]
    return prompts, lengths, want


def test_concurrent_streams_equal_offline_greedy() -> None:
    prompts, lengths, want = offline_greedy_case()

    async def main() -> list[list[int]]:
        async with running() as engine:
            return await asyncio.gather(*(
                collect(engine, f"r{i}", p, greedy(n)) for i, (p, n) in
                enumerate(zip(prompts, lengths))))

    assert asyncio.run(main()) == want


def test_deltas_arrive_step_by_step_and_merge_for_a_slow_consumer() -> None:
    prompt = random_prompts(1)[0]

    async def idle(engine: AsyncEngine) -> bool:
        return await engine.call(lambda e: not e.has_unfinished_requests())

    async def main() -> None:
        async with running() as engine:
            want = await collect(engine, "ref", prompt, greedy(12, ignore_eos=True))
            # A consumer that keeps up: the engine takes its next step only once the
            # consumer has read the last output, so every output is one step's delta.
            await gate(engine, steps=1)
            outs = []
            async for o in engine.generate("r", prompt, greedy(12, ignore_eos=True)):
                outs.append(o)
                await gate(engine, steps=1)
            assert [len(o.outputs[0].token_ids) for o in outs] == [1] * 12
            assert [o.finished for o in outs] == [False] * 11 + [True]

            # A consumer that lags: it reads the first output, then waits until the
            # engine has finished the request; the 11 deltas waiting come as one.
            await gate(engine, steps=1)
            merged, text = [], ""
            async for o in engine.generate("s", prompt, greedy(12, ignore_eos=True)):
                merged.append(o)
                text += o.outputs[0].text
                if len(merged) == 1:
                    await gate(engine)  # unheld: the engine runs ahead of the consumer
                    await wait_until(lambda: idle(engine))
            tokens = [t for o in merged for t in o.outputs[0].token_ids]
            assert tokens == want
            assert [len(o.outputs[0].token_ids) for o in merged] == [1, 11]
            assert merged[-1].finished
            assert text == "".join(o.outputs[0].text for o in outs)

    asyncio.run(main())


@pytest.mark.parametrize("stage", ["waiting", "prefilling", "decoding"])
def test_abort_at_any_stage_frees_blocks(stage: str) -> None:
    """Close a request's stream while it waits, mid-prefill, or decoding: blocks come back."""
    long_prompt = random_prompts(1, lo=200, hi=200, seed=3)[0]

    def stage_of(e: LLMEngine) -> str:
        req = e.scheduler.requests["target"]
        if req.num_computed_tokens == 0:
            return "waiting"
        return "prefilling" if not req.output_token_ids else "decoding"

    async def main() -> None:
        async with running(max_num_seqs=1, max_num_batched_tokens=8) as engine:
            free_at_start = await engine.call(lambda e: e.kv.num_free_blocks)
            await gate(engine, steps=0)  # nothing moves until both are queued
            blocker = None
            if stage == "waiting":  # a long request holds the only running slot
                blocker = await engine.add_request("blocker", long_prompt,
                                                   greedy(200, ignore_eos=True))
            stream = await engine.add_request("target", long_prompt,
                                              greedy(200, ignore_eos=True))
            # Step until the target is at its stage, then hold it there: 200 prompt
            # tokens take 25 steps of 8, however fast or slow they are.
            await gate(engine, until=lambda e: stage_of(e) == stage)
            await wait_until(lambda: held(engine))
            assert await engine.call(stage_of) == stage
            stream.close()
            if blocker is not None:
                blocker.close()
            await wait_until(lambda: pool_is_back(engine, free_at_start))
            aborted = [m.finish_reason for m in engine.finished_metrics]  # the front end's
            assert "abort" in aborted

    asyncio.run(main())


def test_cancelled_consumer_aborts_its_request() -> None:
    async def main() -> None:
        async with running() as engine:
            free_at_start = await engine.call(lambda e: e.kv.num_free_blocks)
            await gate(engine, steps=1)  # held after the first token: it cannot finish
            started = asyncio.Event()

            async def consume() -> None:
                async for _ in engine.generate("r", random_prompts(1)[0],
                                               greedy(400, ignore_eos=True)):
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()  # what the server sees when a client disconnects
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await wait_until(lambda: pool_is_back(engine, free_at_start))
            reasons = [m.finish_reason for m in engine.finished_metrics]
            assert reasons == ["abort"]

    asyncio.run(main())


def test_timeout_aborts_the_request() -> None:
    async def main() -> None:
        async with running() as engine:
            free_at_start = await engine.call(lambda e: e.kv.num_free_blocks)
            # Held after two steps, so the request cannot finish before its timeout.
            await gate(engine, steps=2)
            stream = await engine.add_request("r", random_prompts(1)[0],
                                              greedy(300, ignore_eos=True), timeout_s=0.2)
            got = 0

            async def consume() -> None:
                nonlocal got
                async for out in stream:
                    got += len(out.outputs[0].token_ids)

            with pytest.raises(RequestTimeoutError, match=r"0\.2 s"):
                await asyncio.wait_for(consume(), 30)  # a missing timeout fails, not hangs
            assert got <= 2
            await wait_until(lambda: pool_is_back(engine, free_at_start))

    asyncio.run(main())


def test_a_bad_request_fails_alone() -> None:
    async def main() -> None:
        async with running() as engine:
            tokenizer = engine.info.tokenizer  # the front end's: it tokenizes, not the core
            real_encode = tokenizer.encode

            def encode(text, **kw):
                if text == "explode":
                    raise RuntimeError("tokenizer bug")
                return real_encode(text, **kw)

            tokenizer.encode = encode
            good = collect(engine, "good", random_prompts(1)[0], greedy(8, ignore_eos=True))
            too_long = collect(engine, "long", [5] * 600, greedy(4))
            buggy = collect(engine, "bug", "explode", greedy(4))
            results = await asyncio.gather(good, too_long, buggy, return_exceptions=True)
            assert len(results[0]) == 8
            assert isinstance(results[1], ValueError) and "max_model_len" in str(results[1])
            assert isinstance(results[2], RuntimeError) and "tokenizer bug" in str(results[2])
            assert engine.is_alive

    asyncio.run(main())


def test_queue_full_is_refused_at_once() -> None:
    async def main() -> None:
        async with running(max_num_seqs=1, max_queue_len=1) as engine:
            prompt = random_prompts(1)[0]
            await gate(engine, steps=0)
            running_one = await engine.add_request("a", prompt, greedy(300, ignore_eos=True))
            await gate(engine, steps=1)  # a starts, then holds its slot: it cannot finish

            async def a_is_running() -> bool:
                return await engine.call(lambda e: e.scheduler.num_running == 1)

            await wait_until(a_is_running)
            waiting_one = await engine.add_request("b", prompt, greedy(300, ignore_eos=True))
            with pytest.raises(QueueFullError, match="full"):
                await engine.add_request("c", prompt, greedy(4))
            assert await engine.call(lambda e: e.stats()["num_rejected"]) == 1
            running_one.close()
            waiting_one.close()

    asyncio.run(main())


def test_a_failing_step_fails_the_requests_in_flight_and_the_loop_goes_on() -> None:
    async def main() -> None:
        async with running() as engine:
            free_at_start = await engine.call(lambda e: e.kv.num_free_blocks)
            executor = engine.core.executor
            real_execute = executor.execute_model
            calls = 0

            def execute(sched_out):
                nonlocal calls
                calls += 1
                if calls == 3:
                    raise RuntimeError("injected fault")
                return real_execute(sched_out)

            executor.execute_model = execute
            await gate(engine, steps=0)  # all three are in flight before the first step
            tasks = [asyncio.ensure_future(collect(engine, f"r{i}", p, greedy(50, ignore_eos=True)))
                     for i, p in enumerate(random_prompts(3))]

            async def three_queued() -> bool:
                return await engine.call(lambda e: len(e.scheduler.requests) == 3)

            await wait_until(three_queued)
            await gate(engine)
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
            assert all(isinstance(r, EngineStepError) for r in results), results
            assert "injected fault" in str(results[0])
            await wait_until(lambda: pool_is_back(engine, free_at_start))
            assert engine.is_alive and engine.core.num_step_errors == 1
            # New requests are served as before.
            assert len(await collect(engine, "after", random_prompts(1)[0],
                                     greedy(5, ignore_eos=True))) == 5

    asyncio.run(main())


def test_shutdown_fails_streams_and_refuses_new_requests() -> None:
    async def main() -> None:
        engine = AsyncEngine(LLMEngine(engine_args()))
        engine.start()
        await gate(engine, steps=1)  # held after the first token: the request stays in flight
        stream = await engine.add_request("r", random_prompts(1)[0],
                                          greedy(400, ignore_eos=True))
        await stream.__anext__()
        assert engine.is_alive
        await engine.shutdown()
        assert not engine.is_alive

        async def drain() -> None:
            async for _ in stream:
                pass

        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(drain(), 30)  # a stream left open fails, not hangs
        with pytest.raises(EngineDeadError):
            await engine.add_request("s", [5, 6], greedy(2))

    asyncio.run(main())


def test_finish_listeners_see_finished_and_aborted_requests() -> None:
    async def main() -> list[RequestMetrics]:
        seen: list[RequestMetrics] = []
        async with running() as engine:
            engine.finish_listeners.append(seen.extend)
            await collect(engine, "done", random_prompts(1)[0], greedy(3, ignore_eos=True))
            await gate(engine, steps=1)  # held after its first token: "gone" cannot finish
            stream = await engine.add_request("gone", random_prompts(1)[0],
                                              greedy(400, ignore_eos=True))
            await stream.__anext__()
            stream.close()

            async def two_seen() -> bool:
                return len(seen) == 2

            await wait_until(two_seen)
            assert engine.finished_metrics == seen
        return seen

    done, gone = asyncio.run(main())
    assert (done.finish_reason, done.num_generation_tokens) == ("length", 3)
    assert done.ttft is not None and done.e2e_latency >= done.ttft
    assert gone.finish_reason == "abort" and gone.num_generation_tokens >= 1


def test_aborting_n_samples_reports_every_child() -> None:
    engine = LLMEngine(EngineArgs(model="tiny", attention_backend="sdpa"))
    engine.add_request([5, 6, 7], SamplingParams(n=3, max_tokens=50, ignore_eos=True),
                       request_id="x")
    engine.step()
    engine.abort_request("x")
    aborted = [m for m in engine.finished_metrics if m.finish_reason == "abort"]
    assert len(aborted) == 3 and engine.num_finished == 3
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
