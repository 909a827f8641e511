"""Server limits on a real server process: API key, admission control (429), request
timeout (408 / an error event), and a SIGTERM that drains the requests in flight."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import pytest

from helpers import make_checkpoint
from server_helpers import ServerProcess, serve, wait_for

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


def test_full_queue_is_refused_at_once_with_429(server: ServerProcess) -> None:
    wait_idle(server)
    rejected_before = server.metrics()["conveyor:num_requests_rejected_total"]
    # 20 sequences: one runs, 19 wait, more than --max-queue-len 16.
    body = {"model": MODEL, "prompt": "ba be bi", "n": 20, "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with httpx.Client(headers=server.headers, timeout=30) as http, http.stream(
            "POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()  # kept: dropping it would close the connection
        first = next(line for line in lines if line)
        assert first.startswith('data: {"id"')
        refused = http.post(server.url + "/v1/completions",
                            json={"model": MODEL, "prompt": "ba", "max_tokens": 2})
    # 429, not a 408 after waiting behind 20 x 400 tokens: refused at once.
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "queue_full"
    assert server.metrics()["conveyor:num_requests_rejected_total"] == rejected_before + 1
    wait_idle(server)  # the stream's request was aborted when it was closed


def test_request_timeout_aborts_with_an_error(server: ServerProcess) -> None:
    wait_idle(server)
    # 8 x 500 tokens one sequence at a time: far longer than the 1 s timeout.
    body = {"model": MODEL, "prompt": "ba be bi", "n": 8, "max_tokens": 500,
            "ignore_eos": True}
    results: dict[str, object] = {}

    def streaming() -> None:
        with httpx.stream("POST", server.url + "/v1/completions",
                          json={**body, "stream": True}, headers=server.headers,
                          timeout=60) as r:
            results["stream_status"] = r.status_code
            results["events"] = [line for line in r.iter_lines() if line]

    thread = threading.Thread(target=streaming)
    thread.start()
    t0 = time.monotonic()
    r = post(server, "/v1/completions", body)
    elapsed = time.monotonic() - t0
    thread.join(60)
    assert r.status_code == 408, r.text
    assert r.json()["error"]["code"] == "request_timeout"
    assert TIMEOUT_S <= elapsed < 30
    assert results["stream_status"] == 200  # the headers went out before the timeout
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
