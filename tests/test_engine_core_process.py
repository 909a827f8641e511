"""The engine loop in its own process: same tokens, same per-request faults, and a dead
engine core fails every open stream instead of hanging it."""

from __future__ import annotations

import asyncio

import pytest

from conveyor.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
)
from conveyor.engine.core_process import EngineCoreStartError
from conveyor.engine.messages import UtilityMethod
from conveyor.outputs import RequestMetrics

from helpers import random_prompts
from test_async_engine import collect, engine_args, greedy, offline_greedy_case, wait_until


# Only typed utility calls cross the process boundary.
async def free_blocks(engine: AsyncEngine) -> int:
    return await engine.utility(UtilityMethod.NUM_FREE_BLOCKS)


async def idle_with_pool_back(engine: AsyncEngine) -> tuple[bool, int]:
    assert await engine.utility(UtilityMethod.CHECK_INVARIANTS)
    return (not await engine.utility(UtilityMethod.HAS_UNFINISHED),
            await free_blocks(engine))


async def hold(engine: AsyncEngine, steps: int) -> None:
    """Let ``steps`` more steps run in the engine core, then hold it (whatever its speed)."""
    await engine.utility(UtilityMethod.PAUSE, steps)


def test_process_engine_serves_like_the_thread_engine_and_faults_stay_local() -> None:
    prompts, lengths, want = offline_greedy_case()

    async def main() -> None:
        engine = AsyncEngine.from_engine_args(
            engine_args(max_num_seqs=2, max_queue_len=2), process=True)
        assert engine.core is None and engine.info.tokenizer is not None
        assert engine.info.max_model_len == engine.info.config.model.max_model_len
        seen: list[RequestMetrics] = []
        engine.finish_listeners.append(seen.extend)
        engine.start()
        try:
            free_at_start = await free_blocks(engine)
            # Greedy tokens equal the offline engine's, under concurrency.
            got = []
            for i in range(0, 6, 2):  # two at a time: the queue holds 2
                got += await asyncio.gather(*(
                    collect(engine, f"r{j}", prompts[j], greedy(lengths[j]))
                    for j in (i, i + 1)))
            assert got == want
            # Every output carries its prompt (the front end has it: the core sends none).
            outs = [o async for o in engine.generate("p", prompts[0], greedy(6))]
            # Deltas of 6 tokens in all (a consumer that lags gets some merged).
            assert sum(len(o.outputs[0].token_ids) for o in outs) == 6
            assert all(o.prompt_token_ids == prompts[0] for o in outs)
            assert outs[-1].metrics.num_generation_tokens == 6
            # Bad input fails alone, with its own error type and message.
            too_long = collect(engine, "long", [5] * 600, greedy(4))
            good = collect(engine, "good", prompts[0], greedy(8, ignore_eos=True))
            results = await asyncio.gather(too_long, good, return_exceptions=True)
            assert isinstance(results[0], ValueError) and "max_model_len" in str(results[0])
            assert len(results[1]) == 8
            # A callable cannot cross the process boundary: a clear error, nothing sent.
            with pytest.raises(TypeError, match="another process"):
                await engine.call(lambda e: 1)
            # Admission control crosses too. The engine core is held (whatever its speed)
            # once a and b run, so that none of the four can finish and free a place.
            await hold(engine, 0)
            a = await engine.add_request("a", prompts[1], greedy(300, ignore_eos=True))
            b = await engine.add_request("b", prompts[2], greedy(300, ignore_eos=True))
            await hold(engine, 1)

            async def two_running() -> bool:
                return (await engine.stats())["num_running"] == 2

            await wait_until(two_running)
            c = await engine.add_request("c", prompts[3], greedy(300, ignore_eos=True))
            d = await engine.add_request("d", prompts[4], greedy(300, ignore_eos=True))
            with pytest.raises(QueueFullError, match="full"):
                await engine.add_request("e", prompts[5], greedy(4))
            for stream in (a, b, c, d):
                stream.close()

            await engine.utility(UtilityMethod.RESUME)

            async def pool_back() -> bool:
                return await idle_with_pool_back(engine) == (True, free_at_start)

            await wait_until(pool_back)
            stats = await engine.stats()
            assert stats["num_rejected"] == 1 and stats["num_free_kv_blocks"] == free_at_start
            # Finished and aborted requests reached the listeners of this process.
            reasons = sorted(m.finish_reason for m in seen)
            assert reasons.count("abort") == 4 and reasons.count("length") >= 7
        finally:
            await engine.shutdown()
        assert not engine.is_alive
        assert engine._backend.process.exitcode == 0
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", [5, 6], greedy(2))

    asyncio.run(main())


def test_a_dead_engine_core_fails_open_streams_and_calls() -> None:
    async def main() -> None:
        engine = AsyncEngine.from_engine_args(engine_args(), process=True)
        engine.start()
        await hold(engine, 1)  # held after the first token: the request stays open
        stream = await engine.add_request("r", random_prompts(1)[0],
                                          greedy(400, ignore_eos=True))
        await stream.__anext__()
        engine._backend.process.kill()  # what an out-of-memory kill looks like

        async def drain() -> None:
            async for _ in stream:
                pass

        with pytest.raises(EngineDeadError, match="died"):
            await asyncio.wait_for(drain(), 30)  # an open stream left hanging fails
        assert not engine.is_alive
        with pytest.raises(EngineDeadError):
            await free_blocks(engine)
        await engine.shutdown()

    asyncio.run(main())


def test_an_engine_core_that_cannot_start_says_why() -> None:
    with pytest.raises(EngineCoreStartError, match="could not start"):
        AsyncEngine.from_engine_args(engine_args(model="/nonexistent/model"), process=True)
