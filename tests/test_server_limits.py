"""Server limits: API key, admission control (429), request timeout (408 / an error
event), and a SIGTERM that drains the requests in flight, on a real server process; the
full queue in-process, with the engine held so that nothing leaves the queue meanwhile."""

from __future__ import annotations

import asyncio
import functools
import json
import signal
import threading
import time

import httpx
import openai
import pytest

from helpers import gate_steps, make_checkpoint
from server_helpers import ServerProcess, engine_frozen, serve, wait_for
from test_server_app import app_client

KEY = "s3cret-key"
MODEL = "m"
TIMEOUT_S = 1.0
# One running sequence at a time, so that n > 1 requests queue their own children:
# a request of n sequences of L tokens needs at least n * L engine steps.
ARGS = ("--served-model-name", MODEL, "--max-num-seqs", "1", "--max-queue-len", "16",
        "--request-timeout", str(TIMEOUT_S))


@pytest.fixture(scope="module")
def server():
    with serve(make_checkpoint("llama"), *ARGS, api_key=KEY) as s:
        yield s


def post(server: ServerProcess, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=60, **kw)


def wait_idle(server: ServerProcess) -> None:
    def idle() -> bool:
        m = server.metrics()
        return (m["conveyor:num_requests_running"] == 0
                and m["conveyor:num_requests_waiting"] == 0
                and m["conveyor:kv_cache_free_blocks"] == m["conveyor:kv_cache_total_blocks"])

    wait_for(idle, what="an idle engine with every block free")


def test_health_is_open_and_every_other_route_needs_the_key(server: ServerProcess) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(server.url + path).status_code == 401
        wrong = httpx.get(server.url + path, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        assert wrong.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url + path, headers=server.headers).status_code == 200
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "ba", "max_tokens": 1})
    assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope",
                      max_retries=0).models.list()
    ok = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert ok.completions.create(model=MODEL, prompt="ba be", max_tokens=2).choices


def test_full_queue_is_refused_at_once_with_429() -> None:
    """n sequences count against max_queue_len 16: 10 (one runs, 9 wait) + 7 fill it. The
    engine is held meanwhile (no step runs), so the queue stays full however fast or slow
    the machine: the refusal can only come at once, from admission control."""

    async def wait_until(predicate) -> None:
        deadline = time.monotonic() + 30
        while not await predicate():
            assert time.monotonic() < deadline, "condition not reached in time"
            await asyncio.sleep(0.01)

    async def main() -> None:
        async with app_client({"max_num_seqs": 1, "max_queue_len": 16}) as (client, state):
            engine = state.engine

            async def counts(running: int, waiting: int) -> bool:
                now = await engine.call(lambda e: (e.scheduler.num_running,
                                                   e.scheduler.num_waiting))
                return now == (running, waiting)

            async def rejected() -> float:
                r = await client.get("/metrics")
                line = next(ln for ln in r.text.splitlines()
                            if ln.startswith("conveyor:num_requests_rejected_total"))
                return float(line.split()[-1])

            free_at_start = await engine.call(lambda e: e.kv.num_free_blocks)
            rejected_before = await rejected()
            body = {"prompt": "ba be bi", "max_tokens": 4, "ignore_eos": True,
                    "temperature": 0}
            await engine.call(functools.partial(gate_steps, steps=0))
            first = asyncio.ensure_future(client.post("/v1/completions",
                                                      json={**body, "n": 10}))
            await wait_until(lambda: counts(0, 10))
            await engine.call(functools.partial(gate_steps, steps=1))  # one starts, held
            await wait_until(lambda: counts(1, 9))
            second = asyncio.ensure_future(client.post("/v1/completions",
                                                       json={**body, "n": 7}))
            await wait_until(lambda: counts(1, 16))
            # (Bounded waits: an admitted request would wait for the held engine forever.)
            refused = await asyncio.wait_for(client.post(
                "/v1/completions", json={"prompt": "ba", "max_tokens": 2}), 30)
            too_many = await asyncio.wait_for(client.post(
                "/v1/completions", json={"prompt": "ba", "max_tokens": 2, "n": 17}), 30)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "queue_full"
            # More samples than the queue can ever hold is a bad request, not a busy server.
            assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
            assert await rejected() == rejected_before + 1
            # Released, the queued requests are served as usual and every block comes back.
            await engine.call(functools.partial(gate_steps, steps=None))
            done = await asyncio.wait_for(asyncio.gather(first, second), 60)
            assert [r.status_code for r in done] == [200, 200]
            assert [len(r.json()["choices"]) for r in done] == [10, 7]
            assert await engine.call(lambda e: e.kv.num_free_blocks) == free_at_start

    asyncio.run(main())


def test_more_samples_than_the_queue_holds_is_a_400(server: ServerProcess) -> None:
    """--max-queue-len reaches the real server (the 429 itself is tested in-process)."""
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "ba", "max_tokens": 2,
                                         "n": 17})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "max_queue_len 16" in r.json()["error"]["message"]


def test_request_timeout_aborts_with_an_error(server: ServerProcess) -> None:
    wait_idle(server)
    body = {"model": MODEL, "prompt": "ba be bi", "n": 8, "max_tokens": 500,
            "ignore_eos": True}
    results: dict[str, object] = {}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      headers=server.headers, timeout=60) as stream:
        # The headers went out: the engine queued the stream's request. From here the
        # engine core is stopped, so neither request can finish before its timeout,
        # however fast the machine; the front end still times them out.
        assert stream.status_code == 200
        with engine_frozen(server):

            def streaming() -> None:
                results["events"] = [line for line in stream.iter_lines() if line]

            thread = threading.Thread(target=streaming)
            thread.start()
            t0 = time.monotonic()
            r = post(server, "/v1/completions", body)
            elapsed = time.monotonic() - t0
            thread.join(60)
    assert r.status_code == 408, r.text
    assert r.json()["error"]["code"] == "request_timeout"
    assert elapsed >= TIMEOUT_S  # it waited its timeout (the engine was frozen meanwhile)
    events = results["events"]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][len("data: "):])["error"]
    assert error["code"] == "request_timeout" and "1 s" in error["message"]
    wait_idle(server)
    m = server.metrics()
    assert m['conveyor:request_success_total{finished_reason="abort"}'] >= 2


def test_sigterm_drains_requests_in_flight(server: ServerProcess) -> None:
    """Runs last: the server stops here."""
    wait_idle(server)
    body = {"model": MODEL, "prompt": "ba be bi", "max_tokens": 12, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body,
                      headers=server.headers, timeout=60) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    events = [first, *rest]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert "error" not in chunks[-1] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    # Uvicorn re-raises the signal once it has shut down, so the exit status says SIGTERM;
    # the complete stream above is what shows the request was drained first.
    assert server.proc.wait(timeout=30) in (0, -signal.SIGTERM)
    assert "Traceback" not in server.log()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=2)
