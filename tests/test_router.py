"""``conveyor router`` end to end: two real ``conveyor serve`` replicas on loopback ports
behind a real router process. Greedy outputs through the router equal one engine's;
prefix routing keeps a conversation on one replica (hits counted by the replicas' own
/metrics); a replica killed mid-request fails that request with a clear error, new
requests go to the other, and it rejoins once restarted."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal

import httpx
import pytest

from conveyor.core.kv_cache_manager import prompt_block_hashes
from conveyor.router.launcher import replica_argv

from helpers import make_checkpoint
from server_helpers import (
    ServerProcess,
    engine_core_pid,
    engine_frozen,
    router,
    serve,
    wait_for,
)

MODEL = "tiny-llama"
BLOCK = 8
REPLICA_ARGS = ("--served-model-name", MODEL, "--block-size", str(BLOCK),
                "--num-kv-blocks", "256", "--max-num-seqs", "8")
TIMEOUT = httpx.Timeout(60.0)


@pytest.fixture(scope="module")
def checkpoint() -> str:
    return make_checkpoint("llama")


@contextlib.contextmanager
def replicas(checkpoint: str, n: int = 2):
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(serve(checkpoint, *REPLICA_ARGS, wait=False))
                   for _ in range(n)]
        for s in servers:  # booted side by side
            s.wait_ready(180.0)
        yield servers


@pytest.fixture(scope="module")
def fleet(checkpoint: str):
    with replicas(checkpoint) as servers, \
            router([s.url for s in servers], "--routing", "prefix",
                   "--health-interval", "0.2") as r:
        yield r, servers


def completion(url: str, prompt, **kw) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}
    return httpx.post(url + "/v1/completions", json=body, timeout=TIMEOUT)


def hits(server: ServerProcess) -> float:
    return server.metrics()["conveyor:prefix_cache_hits_total"]


def replica_states(r: ServerProcess) -> list[dict]:
    return httpx.get(r.url + "/router/replicas", timeout=TIMEOUT).json()["replicas"]


def test_health_models_and_greedy_equal_one_engine(fleet) -> None:
    r, servers = fleet
    assert httpx.get(r.url + "/health", timeout=TIMEOUT).status_code == 200
    models = httpx.get(r.url + "/v1/models", timeout=TIMEOUT).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    for prompt in ("ba be bi bo", "da de di do du fa", [5, 6, 7, 8, 9]):
        direct = completion(servers[0].url, prompt).json()
        routed = completion(r.url, prompt).json()
        assert routed["choices"][0]["text"] == direct["choices"][0]["text"]
        assert routed["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "ka ke ki"}],
            "max_tokens": 8, "temperature": 0}
    direct = httpx.post(servers[1].url + "/v1/chat/completions", json=chat, timeout=TIMEOUT)
    routed = httpx.post(r.url + "/v1/chat/completions", json=chat, timeout=TIMEOUT)
    assert routed.json()["choices"][0]["message"] == direct.json()["choices"][0]["message"]


def test_streaming_passes_through(fleet) -> None:
    r, servers = fleet
    body = {"model": MODEL, "prompt": "la le li lo lu", "max_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", r.url + "/v1/completions", json=body, timeout=TIMEOUT) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == completion(servers[0].url, "la le li lo lu").json()["choices"][0]["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == 8


def test_kv_summary_holds_the_engines_own_hashes(fleet) -> None:
    _, servers = fleet
    tokens = list(range(20, 20 + 4 * BLOCK + 3))
    assert completion(servers[0].url, tokens, max_tokens=1).status_code == 200
    summary = httpx.get(servers[0].url + "/v1/kv_summary", timeout=TIMEOUT).json()
    assert summary["block_size"] == BLOCK
    want = prompt_block_hashes(tokens, BLOCK, bytes.fromhex(summary["hash_key"]))
    got = set(summary["block_hashes"])
    assert [h[:summary["hash_bytes"]].hex() in got for h in want] == [True] * 4
    capped = httpx.get(servers[0].url + "/v1/kv_summary", params={"max_blocks": 2},
                       timeout=TIMEOUT).json()
    assert len(capped["block_hashes"]) == 2
    bad = httpx.get(servers[0].url + "/v1/kv_summary", params={"max_blocks": "-1"},
                    timeout=TIMEOUT)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_blocks"


def test_prefix_routing_keeps_a_conversation_on_one_replica(fleet) -> None:
    """Three turns of each of two conversations: every later turn hits the prefix cache,
    all on one replica (round-robin would send turn 2 to the other, which holds nothing).
    The second conversation's first turn goes straight to replica 1: the router learns it
    from that replica's /v1/kv_summary alone, and sends the next turns there."""
    r, servers = fleet
    for conv in range(2):
        # Whole blocks per turn: the reply's partial block is never cached, so turn k hits
        # exactly turn k-1's prompt.
        prompt = [100 + conv, *range(200 + 40 * conv, 200 + 40 * conv + 4 * BLOCK - 1)]
        where = set()
        for turn in range(3):
            before = [hits(s) for s in servers]
            if conv == 1 and turn == 0:
                known = replica_states(r)[1]["summary_blocks"]
                resp = completion(servers[1].url, prompt, max_tokens=4)
                wait_for(lambda k=known: replica_states(r)[1]["summary_blocks"] >= k + 4, 30,
                         "replica 1's summary")
            else:
                resp = completion(r.url, prompt, max_tokens=4)
            assert resp.status_code == 200, resp.text
            gained = [hits(s) - b for s, b in zip(servers, before)]
            if turn:
                assert sorted(gained) == [0, len(prompt) - 2 * BLOCK], gained
                where.add(max(range(2), key=lambda i: gained[i]))
            prompt = prompt + list(range(300 + 20 * turn, 300 + 20 * turn + 2 * BLOCK))
        assert len(where) == 1
        if conv == 1:
            assert where == {1}


def aborted(server: ServerProcess) -> float:
    return server.metrics().get('conveyor:request_success_total{finished_reason="abort"}', 0.0)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_aborts_its_request_on_the_replica(fleet, stream: bool) -> None:
    """Both engines stopped: the request is in flight for certain when the client gives up;
    the replica that had it counts it aborted, and the router holds nothing for it."""
    r, servers = fleet
    before = [aborted(s) for s in servers]
    body = {"model": MODEL, "prompt": "na ne ni no", "max_tokens": 64, "ignore_eos": True,
            "stream": stream}
    with contextlib.ExitStack() as frozen:
        for s in servers:
            frozen.enter_context(engine_frozen(s))
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(r.url + "/v1/completions", json=body, timeout=httpx.Timeout(1.0))
    wait_for(lambda: sum(aborted(s) - b for s, b in zip(servers, before)) == 1, 30,
             "the abort on a replica")
    wait_for(lambda: sum(x["in_flight"] for x in replica_states(r)) == 0, 30, "nothing held")


def test_bad_input_is_the_replicas_clear_error(fleet) -> None:
    r, _ = fleet
    resp = completion(r.url, "ba be", max_tokens=-3)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "max_tokens"
    resp = httpx.post(r.url + "/v1/completions", content=b"{not json", timeout=TIMEOUT,
                      headers={"Content-Type": "application/json"})
    assert resp.status_code == 400 and "error" in resp.json()


def _kill(server: ServerProcess) -> None:
    """SIGKILL the replica's engine-core process and its front end: no graceful anything."""
    core = engine_core_pid(server)
    os.kill(server.proc.pid, signal.SIGKILL)
    os.kill(core, signal.SIGKILL)
    server.proc.wait(timeout=30)


def _stream_result(url: str) -> tuple[int, list[str]]:
    body = {"model": MODEL, "prompt": "ma me mi", "max_tokens": 64, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=TIMEOUT) as resp:
        return resp.status_code, [line for line in resp.iter_lines() if line]


def _failed_cleanly(status: int, lines: list[str], url: str) -> bool:
    """A 502 before the stream began, or an error event in it: either names the replica."""
    if status == 502:
        err = json.loads(lines[0])["error"]
    else:
        events = [json.loads(x.removeprefix("data: ")) for x in lines if x != "data: [DONE]"]
        err = events[-1].get("error")
    return err is not None and err["code"] == "replica_failed" and url in err["message"]


def test_killed_replica_fails_its_requests_cleanly_and_rejoins(checkpoint: str) -> None:
    with replicas(checkpoint) as servers, \
            router([s.url for s in servers], "--routing", "round-robin",
                   "--health-interval", "0.2") as r:
        victim = servers[0]
        # The victim's engine is stopped, so its requests are certainly in flight when it
        # dies. Round-robin: the 1st and 3rd request go to the victim, the 2nd to the other.
        os.kill(engine_core_pid(victim), signal.SIGSTOP)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            plain = pool.submit(completion, r.url, "ma me mi", max_tokens=64, ignore_eos=True)
            wait_for(lambda: replica_states(r)[0]["in_flight"] == 1, 30, "1st in flight")
            status, lines = pool.submit(_stream_result, r.url).result(timeout=60)
            assert status == 200 and lines[-1] == "data: [DONE]"  # the other's, untouched
            streamed = pool.submit(_stream_result, r.url)
            wait_for(lambda: replica_states(r)[0]["in_flight"] == 2, 30, "3rd in flight")
            _kill(victim)
            err = plain.result(timeout=60)
            assert err.status_code == 502, err.text
            assert err.json()["error"]["code"] == "replica_failed"
            assert victim.url in err.json()["error"]["message"]
            assert _failed_cleanly(*streamed.result(timeout=60), victim.url)
        states = replica_states(r)
        assert not states[0]["healthy"] and states[1]["healthy"]
        assert states[0]["in_flight"] == 0
        # New requests go to the survivor.
        before = states[1]["routed"]
        for _ in range(3):
            assert completion(r.url, "ba be bi").status_code == 200
        assert replica_states(r)[1]["routed"] == before + 3
        # Restarted on its port, it is back in rotation and takes requests again.
        port = int(victim.url.rsplit(":", 1)[1])
        with serve(checkpoint, *REPLICA_ARGS, port=port):
            wait_for(lambda: replica_states(r)[0]["healthy"], 30, "rejoined")
            before = replica_states(r)[0]["routed"]
            for _ in range(2):
                assert completion(r.url, "ba be bi").status_code == 200
            assert replica_states(r)[0]["routed"] == before + 1


def test_a_stalled_replica_is_bounded_by_the_routers_request_timeout(checkpoint: str) -> None:
    """An engine stopped (its front end still answers /health): the router's deadline
    fails the request with a 504 (a stream already begun: an error event), and the
    replica, its connection closed, aborts it."""
    with replicas(checkpoint, 1) as servers, \
            router([servers[0].url], "--request-timeout", "3") as r:
        body = {"model": MODEL, "prompt": "pa pe pi", "max_tokens": 16, "stream": False}
        with engine_frozen(servers[0]):
            resp = httpx.post(r.url + "/v1/completions", json=body, timeout=TIMEOUT)
        assert resp.status_code == 504, resp.text
        assert resp.json()["error"]["code"] == "replica_timeout"
        wait_for(lambda: aborted(servers[0]) == 1, 30, "the abort on the replica")
        # A stream frozen after its first token: it cannot finish 2,000 more in time.
        body.update(stream=True, max_tokens=2000, ignore_eos=True)
        with httpx.stream("POST", r.url + "/v1/completions", json=body,
                          timeout=TIMEOUT) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            with engine_frozen(servers[0]):
                rest = [line for line in lines if line]
        assert resp.status_code == 200
        assert json.loads(rest[-1].removeprefix("data: "))["error"]["code"] == \
            "replica_timeout"
        wait_for(lambda: aborted(servers[0]) == 2, 30, "the stream's abort")
        assert replica_states(r)[0]["healthy"]  # slow is not dead


def test_no_replica_in_rotation_is_a_503(checkpoint: str) -> None:
    dead = "http://127.0.0.1:9"  # discard port: nothing listens
    with router([dead], "--routing", "round-robin", wait=False) as r:
        wait_for(lambda: _status(r.url + "/v1/models") is not None, 60, "router up")
        assert httpx.get(r.url + "/health", timeout=TIMEOUT).status_code == 503
        resp = completion(r.url, "ba be")
        assert resp.status_code == 503
        assert resp.json()["error"]["code"] == "no_replica_available"
        assert dead in resp.json()["error"]["message"]


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2.0).status_code
    except httpx.HTTPError:
        return None


def test_replica_argv_drops_the_launchers_own_options() -> None:
    argv = ["--model", "m", "--data-parallel-size", "2", "--port=9", "--routing", "prefix",
            "--host", "0.0.0.0", "--num-threads", "1"]
    assert replica_argv(argv) == ["--model", "m", "--num-threads", "1"]


def test_serve_data_parallel_size_is_replicas_behind_a_router(checkpoint: str) -> None:
    with serve(checkpoint, *REPLICA_ARGS, "--data-parallel-size", "2",
               "--routing", "round-robin") as s:
        wait_for(lambda: all(x["healthy"] for x in replica_states(s)), 120, "both replicas")
        urls = [x["url"] for x in replica_states(s)]
        texts = {completion(s.url, "ba be bi bo").json()["choices"][0]["text"]
                 for _ in range(2)}
        assert len(texts) == 1  # greedy: the same on either replica
        assert [x["routed"] for x in replica_states(s)] == [1, 1]
    for url in urls:  # the replicas stopped with the router
        assert _status(url + "/health") is None
