"""Ray: two replicas through Ray Serve, and TP=2 through the Ray executor, on a local
Ray instance on loopback (``num_cpus=2``, one per module)."""

from __future__ import annotations

import concurrent.futures

import pytest

from conveyor import LLM, SamplingParams
from conveyor.executor.errors import ExecutorDeadError

from helpers import make_checkpoint, random_prompts

ray = pytest.importorskip("ray")
# Ray Serve's own pydantic models warn on import; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    try:
        yield ray
    finally:
        ray.shutdown()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def test_two_replicas_through_ray_serve_equal_one_engine(local_ray, monkeypatch) -> None:
    import httpx
    from ray import serve

    from conveyor.integrations.ray_serve import REPLICA_HEADER, build_app

    monkeypatch.setenv("CONVEYOR_MEASURE_LINEARS", "0")
    path = make_checkpoint("llama")
    prompts = random_prompts(8, lo=3, hi=40, seed=21)
    max_tokens = [4 + i for i in range(len(prompts))]
    want = [o.outputs[0].text for o in LLM(path, dtype="float32", num_threads=1).generate(
        [{"prompt_token_ids": p} for p in prompts], [_greedy(n) for n in max_tokens])]
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        app = build_app({"model": path, "dtype": "float32", "num_threads": "1",
                         "warmup": "false", "num_replicas": "2",
                         "num_cpus_per_replica": "0.5"})
        serve.run(app, name="conveyor", route_prefix="/")
        status = serve.status().applications["conveyor"].deployments["ConveyorReplica"]
        assert status.replica_states.get("RUNNING") == 2, status

        def complete(i: int) -> dict:
            body = {"model": path, "prompt": prompts[i], "max_tokens": max_tokens[i],
                    "temperature": 0}
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return {**r.json(), "replica": r.headers[REPLICA_HEADER]}

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(complete, range(len(prompts))))
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert health.status_code == 200
    finally:
        serve.shutdown()
    # Ray Serve's router spread the concurrent requests over both replicas.
    assert len({body["replica"] for body in got}) == 2, [body["replica"] for body in got]
    for i, body in enumerate(got):
        assert body["usage"]["completion_tokens"] == max_tokens[i]
        assert body["choices"][0]["text"] == want[i], f"request {i}"


def test_tp2_through_the_ray_executor_equals_one_process(local_ray, monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_MEASURE_LINEARS", "0")
    path = make_checkpoint("qwen2")  # tied embeddings, Q/K/V biases
    prompts = random_prompts(6, lo=2, hi=50, seed=4)
    params = [_greedy(3 + 3 * i) for i in range(len(prompts))]
    kw = dict(dtype="float32", num_threads=1, warmup=False, max_num_batched_tokens=13)
    want = [o.outputs[0].token_ids for o in LLM(path, **kw).generate(
        [{"prompt_token_ids": p} for p in prompts], params)]
    llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray",
              distributed_timeout_s=20, **kw)
    engine = llm.engine
    executor = engine.core.executor
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params)]
        assert got == want
        assert [(r.rank, r.kv_heads, r.kv_cache_shape[1]) for r in executor.rank_info] == [
            (0, [0], 1), (1, [1], 1)]
        # Both ranks sit in this Ray instance's placement group, one bundle each.
        table = ray.util.placement_group_table(executor.pg)
        assert table["state"] == "CREATED" and len(table["bundles"]) == 2
        # A rank's actor killed mid-request: the next step fails, naming it.
        engine.add_request({"prompt_token_ids": prompts[0]},
                           SamplingParams(max_tokens=100, ignore_eos=True), request_id="x")
        engine.step()
        ray.kill(executor.actors[1])
        # Its death is noticed as a death, naming the rank (not as a step that outlived the
        # distributed timeout, which reads "did not answer a step").
        with pytest.raises(ExecutorDeadError, match="rank 1 died"):
            for _ in range(100):
                engine.step()
    finally:
        engine.shutdown()
