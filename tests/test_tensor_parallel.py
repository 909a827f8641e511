"""Tensor parallelism on two gloo processes (one thread each), tiny checkpoints, float32.

The sharded model's logits are within 1e-5 of one process's; greedy tokens through the
multiprocess executor equal one process's and transformers' under continuous batching
(requests joining at different steps), chunked prefill and preemption; each rank's KV
pool holds its half of the KV heads (or its replicated one); seeded sampling and n-gram
drafts agree with one process (the ranks sample alike). A rank killed mid-request, one
that hangs (SIGSTOP) or one that dies while the engine idles ends the engine within the
timeout, never a hang; through ``conveyor serve`` the open stream fails with the rank's
error and ``/health`` turns 503.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

from conveyor import LLM, SamplingParams
from conveyor.config import EngineArgs
from conveyor.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from conveyor.distributed.parallel import HeadSplit, split_heads
from conveyor.engine.llm_engine import LLMEngine
from conveyor.executor.errors import ExecutorDeadError

from helpers import child_pids, hf_greedy, make_checkpoint, random_prompts

LOGIT_TOL = 1e-5
# A checkpoint per sharding case: GQA (4 query heads, 2 KV heads: one each), Qwen3 (tied
# embeddings, q/k norms, head_dim 32), MQA (one KV head: replicated on both ranks); and
# the built-in tiny shape with dummy weights (a rank draws the whole tensor, keeps its part).
LOGIT_CASES = {"llama": ("llama", {}), "qwen3": ("qwen3", {}),
               "mqa": ("llama", {"num_key_value_heads": 1}), "dummy": ("tiny", {})}


def _case_model(name: str) -> str:
    arch, over = LOGIT_CASES[name]
    return "tiny" if arch == "tiny" else make_checkpoint(arch, **over)


def test_heads_split_evenly_or_replicate() -> None:
    assert [split_heads(4, 2, 2, r) for r in (0, 1)] == [HeadSplit(2, 1, 0, 0),
                                                         HeadSplit(2, 1, 2, 1)]
    # 8 ranks over 2 KV heads: ranks 0-3 hold head 0, ranks 4-7 head 1, and each rank's
    # query heads (GQA: head h reads kv head h // 4) read the KV head it holds.
    for rank in range(8):
        s = split_heads(8, 2, 8, rank)
        assert (s.num_heads, s.num_kv_heads, s.kv_start) == (1, 1, rank // 4)
        assert s.q_start // 4 == s.kv_start
    with pytest.raises(ValueError, match="divide"):
        split_heads(4, 2, 3, 0)
    with pytest.raises(ValueError, match="multiple"):
        split_heads(12, 4, 6, 0)


def _steps(prompts: list[list[int]]) -> list[SchedulerOutput]:
    """Three hand-made steps: two prompts (one in two chunks) prefill, then one decodes
    beside the other's last chunk and a third prompt, then all three decode."""
    a, b, c = prompts
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    blocks = {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9, 10, 11]}
    half = len(b) // 2
    s1 = SchedulerOutput(
        new_reqs=[NewRequestData("a", a, [], greedy, blocks["a"], 0),
                  NewRequestData("b", b, [], greedy, blocks["b"], 0)],
        num_scheduled_tokens={"a": len(a), "b": half},
        total_num_scheduled_tokens=len(a) + half, sampling_req_ids={"a"})
    s2 = SchedulerOutput(
        new_reqs=[NewRequestData("c", c, [], greedy, blocks["c"], 0)],
        cached_reqs=[CachedRequestData("a", [], len(a)), CachedRequestData("b", [], half)],
        num_scheduled_tokens={"a": 1, "b": len(b) - half, "c": len(c)},
        total_num_scheduled_tokens=1 + len(b) - half + len(c),
        sampling_req_ids={"a", "b", "c"})
    s3 = SchedulerOutput(
        cached_reqs=[CachedRequestData("a", [], len(a) + 1), CachedRequestData("b", [], len(b)),
                     CachedRequestData("c", [], len(c))],
        num_scheduled_tokens={"a": 1, "b": 1, "c": 1}, total_num_scheduled_tokens=3,
        sampling_req_ids={"a", "b", "c"})
    return [s1, s2, s3]


def _run_steps(args: EngineArgs, worker=None) -> list[dict[str, torch.Tensor]]:
    """Each step's float32 logits per sampling request, on one process or one rank."""
    from conveyor.executor.local import LocalExecutor

    if worker is None:
        executor = LocalExecutor(args)
        runner = executor.runner
    else:
        runner = worker.runner
    num_blocks = 16
    runner.allocate_kv_cache(num_blocks)
    runner.record_logits = True
    out = []
    for step in _steps(random_prompts(3, lo=9, hi=40, seed=3)):
        runner.execute(step)
        out.append(dict(runner.last_logits))
    return out


def _args(path: str, **kw) -> EngineArgs:
    kw.setdefault("warmup", False)
    return EngineArgs(model=path, dtype="float32", num_threads=1, **kw)


def test_tp2_logits_within_1e5_of_one_process_and_kv_heads_halved(monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_MEASURE_LINEARS", "0")
    cases = {name: _args(_case_model(name), tensor_parallel_size=2) for name in LOGIT_CASES}
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    from conveyor.executor.tp_worker import free_port

    ports = [free_port() for _ in cases]
    procs = []
    for rank in range(2):
        p = ctx.Process(target=_rank_main_ports, args=(cases, rank, ports, queue), daemon=True)
        p.start()
        procs.append(p)
    try:
        got = queue.get(timeout=120)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert not isinstance(got, str), got
    for name, (steps, kv_shape) in got.items():
        path = cases[name].model
        want = _run_steps(_args(path))
        assert kv_shape[1] == 1, (name, kv_shape)  # 2 KV heads / 2, or 1 replicated
        for i, (g, w) in enumerate(zip(steps, want, strict=True)):
            assert g.keys() == w.keys() and g, (name, i)
            for rid in w:
                got_logits = torch.tensor(g[rid])
                diff = (got_logits - w[rid]).abs().max().item()
                assert diff <= LOGIT_TOL, f"{name} step {i} request {rid}: |diff| {diff:.2e}"
                assert got_logits.argmax() == w[rid].argmax()
                assert w[rid].abs().max() > 0.1  # real logits, not zeros


def _rank_main_ports(cases, rank, ports, queue) -> None:
    import torch.distributed as dist

    from conveyor.executor.tp_worker import TPWorker

    try:
        results = {}
        for (name, args), port in zip(cases.items(), ports, strict=True):
            if dist.is_initialized():
                dist.destroy_process_group()
            worker = TPWorker(args, rank, f"tcp://127.0.0.1:{port}")
            # Plain lists cross the queue (a tensor would go as shared memory that dies
            # with this process).
            steps = [{rid: t.tolist() for rid, t in step.items()}
                     for step in _run_steps(args, worker)]
            results[name] = (steps, list(worker.runner.kv_caches[0][0].shape))
        if rank == 0:
            queue.put(results)
    except BaseException as e:  # report instead of leaving the test waiting
        queue.put(f"rank {rank}: {type(e).__name__}: {e}")


def _staggered(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int]
               ) -> dict[str, list[int]]:
    """Requests join in three waves, each after a step of the ones before (continuous
    batching: prefills beside decodes); returns each request's token ids."""
    waves = [range(0, 3), range(3, 6), range(6, len(prompts))]
    done: dict[str, list[int]] = {}
    for wave in waves:
        for i in wave:
            engine.add_request({"prompt_token_ids": prompts[i]},
                               SamplingParams(max_tokens=max_tokens[i], temperature=0.0),
                               request_id=str(i))
        for _ in range(2):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish in 120 s"
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


TP_CONFIGS = {
    # Continuous batching with staggered arrivals (llama: untied head, GQA), after the
    # start-up warmup step (every rank runs it).
    "staggered": ("llama", dict(warmup=True)),
    # A 13-token budget chunks most prompts; 9 blocks of 8 for 9 requests preempt
    # (qwen2: tied embeddings, Q/K/V biases).
    "chunked_preempt": ("qwen2", dict(max_num_batched_tokens=13, num_kv_blocks=9,
                                      block_size=8)),
}


@pytest.mark.parametrize("config", list(TP_CONFIGS))
def test_tp2_greedy_equals_one_process_and_transformers(config: str, monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_MEASURE_LINEARS", "0")
    arch, kw = TP_CONFIGS[config]
    path = make_checkpoint(arch)
    prompts = random_prompts(9, lo=2, hi=50, seed=11)
    max_tokens = [3 + (7 * i) % 17 for i in range(len(prompts))]
    single = LLMEngine(_args(path, **kw))
    want = _staggered(single, prompts, max_tokens)
    tp = LLMEngine(_args(path, tensor_parallel_size=2, **kw))
    try:
        got = _staggered(tp, prompts, max_tokens)
        stats = tp.stats()
        info = tp.core.executor.rank_info
    finally:
        tp.shutdown()
    assert got == want
    for i, prompt in enumerate(prompts):
        assert got[str(i)] == hf_greedy(path, prompt, max_tokens[i]), f"request {i}"
    # Each rank's pool: its one of the two KV heads, all blocks of the core's pool.
    assert [(r.kv_heads, r.kv_cache_shape[1]) for r in info] == [([0], 1), ([1], 1)]
    assert all(r.kv_cache_shape[0] == stats["num_kv_blocks"] * (kw.get("block_size", 16))
               for r in info)
    if config == "chunked_preempt":
        assert stats["num_preemptions"] > 0, "the tiny pool should have forced preemptions"
    assert stats["kv_blocks_in_use"] == 0


def test_a_killed_rank_fails_open_requests_within_the_timeout(monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_MEASURE_LINEARS", "0")
    engine = LLMEngine(_args(make_checkpoint("llama"), tensor_parallel_size=2,
                             distributed_timeout_s=20))
    executor = engine.core.executor
    try:
        for i, prompt in enumerate(random_prompts(3, seed=5)):
            engine.add_request({"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=200, ignore_eos=True), request_id=str(i))
        engine.step()
        os.kill(executor.procs[1].pid, signal.SIGKILL)
        # Its death is noticed as a death, naming the rank (not as a step that outlived the
        # distributed timeout, which reads "did not answer a step").
        with pytest.raises(ExecutorDeadError, match="rank 1 died"):
            for _ in range(100):
                engine.step()
        assert not any(p.is_alive() for p in executor.procs), "rank 0 must be stopped too"
        with pytest.raises(ExecutorDeadError):  # and it stays dead
            executor.execute_model(SchedulerOutput())
    finally:
        engine.shutdown()


def test_serve_tp2_answers_then_a_killed_rank_fails_the_stream_and_health(monkeypatch
                                                                          ) -> None:
    import httpx

    monkeypatch.setenv("CONVEYOR_MEASURE_LINEARS", "0")  # the server inherits it

    from server_helpers import engine_core_pid, serve, wait_for

    path = make_checkpoint("llama")
    prompt = random_prompts(1, seed=9)[0]
    with serve(path, "--tensor-parallel-size", "2", "--distributed-timeout", "20",
               "--no-warmup") as server:
        body = {"model": path, "prompt": prompt, "max_tokens": 6, "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
        ranks = child_pids(engine_core_pid(server))
        assert len(ranks) == 2, ranks
        body = {**body, "max_tokens": 400, "stream": True, "ignore_eos": True}
        # The stream must end, not hang: a read that waits 60 s fails the test (httpx's
        # timeout, a failsafe), and the end must be an error event naming the rank.
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=60) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert '"text"' in first
            os.kill(ranks[1], signal.SIGKILL)
            rest = "\n".join(lines)
        assert "error" in rest and "rank" in rest, rest[-500:]
        wait_for(lambda: httpx.get(server.url + "/health", timeout=5).status_code == 503,
                 timeout_s=60, what="/health 503")


def test_a_rank_dying_while_idle_turns_the_engine_dead(monkeypatch) -> None:
    import asyncio

    from conveyor.engine.async_engine import AsyncEngine, EngineDeadError

    monkeypatch.setenv("CONVEYOR_MEASURE_LINEARS", "0")

    async def main() -> None:
        engine = AsyncEngine.from_engine_args(_args(make_checkpoint("llama"),
                                                    tensor_parallel_size=2))
        engine.start()
        executor = engine.core.executor
        assert engine.is_alive
        os.kill(executor.procs[0].pid, signal.SIGKILL)  # no request open: the loop is idle
        # The idle loop asks the executor every second; the deadline is only a failsafe.
        deadline = time.monotonic() + 60
        while engine.is_alive:
            assert time.monotonic() < deadline, "a dead rank went unnoticed while idle"
            await asyncio.sleep(0.05)
        assert not any(p.is_alive() for p in executor.procs)
        with pytest.raises(EngineDeadError, match="rank 0 died"):
            await engine.add_request("late", [5, 6], SamplingParams(max_tokens=2))
        await engine.shutdown()

    asyncio.run(main())


def test_a_model_that_does_not_split_is_refused_before_any_rank_starts() -> None:
    with pytest.raises(ValueError, match="must divide the 4 attention heads"):
        LLMEngine(_args(make_checkpoint("llama"), tensor_parallel_size=3))
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        _args(make_checkpoint("llama"), tensor_parallel_size=0)


def test_tp2_seeded_sampling_and_ngram_drafts_equal_one_process(monkeypatch) -> None:
    """Every rank samples for itself from the gathered logits: a rank that drew another
    token would feed the next step other K/V and the outputs would part from one
    process's. Seeded temperature sampling and verified n-gram drafts show they agree."""
    monkeypatch.setenv("CONVEYOR_MEASURE_LINEARS", "0")
    path = make_checkpoint("llama")
    prompts = [p * 3 for p in random_prompts(4, lo=3, hi=10)]  # repeats: drafts
    kw = dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "adaptive": False})  # k fixed: not timing-dependent
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=5 + i) for i in range(4)]
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    single = LLM(path, dtype="float32", num_threads=1, **kw)
    want = [[o.outputs[0].token_ids for o in single.generate(inputs, sp)]
            for sp in (params, greedy)]
    tp = LLM(path, dtype="float32", num_threads=1, tensor_parallel_size=2, **kw)
    try:
        got = [[o.outputs[0].token_ids for o in tp.generate(inputs, sp)]
               for sp in (params, greedy)]
        spec = tp.stats()["spec_decode"]
    finally:
        tp.shutdown()
    assert got == want
    assert spec["num_accepted_tokens"] > 0, spec


def test_a_hung_rank_fails_the_step_at_the_distributed_timeout(monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_MEASURE_LINEARS", "0")
    engine = LLMEngine(_args(make_checkpoint("llama"), tensor_parallel_size=2,
                             distributed_timeout_s=2))
    executor = engine.core.executor
    try:
        engine.add_request({"prompt_token_ids": [5, 6, 7]},
                           SamplingParams(max_tokens=50, ignore_eos=True), request_id="r")
        engine.step()
        os.kill(executor.procs[1].pid, signal.SIGSTOP)  # alive, but never answers
        start = time.monotonic()
        # Rank 0 waits in a collective for it: neither answers, and the step fails at the
        # timeout, not before it (a lower bound only: a slow machine cannot break it).
        with pytest.raises(ExecutorDeadError, match=r"\[0, 1\] did not answer a step within 2 s"):
            engine.step()
        assert time.monotonic() - start >= 2
        assert not any(p.is_alive() for p in executor.procs)  # a stopped rank is killed too
    finally:
        engine.shutdown()
