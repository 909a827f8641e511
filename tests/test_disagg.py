"""Prefill/decode disaggregation end to end: real ``conveyor serve --kv-role prefill`` and
``--kv-role decode`` processes behind ``conveyor router --prefill --decode``, a tiny float32
checkpoint, loopback only. Outputs equal one engine's (``--kv-role both``) token for token,
greedy and seeded, streamed or not; the bytes moved are exactly the prompt's K/V; the
decode engine computes only the last prompt token. Faults (a prefill killed mid-transfer,
one slower than its lease, a dropped reply, a client that leaves mid-transfer, the fail
fallback): every request ends with an answer equal to the reference or a clear error, and
both KV pools return to their baselines."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import uuid

import httpx
import pytest

from helpers import make_checkpoint, random_prompts
from server_helpers import ServerProcess, free_port, router, serve, wait_for

MODEL = "tiny-llama"
BLOCK = 8
NUM_BLOCKS = 128
COMMON = ("--served-model-name", MODEL, "--block-size", str(BLOCK),
          "--num-kv-blocks", str(NUM_BLOCKS), "--max-num-seqs", "8")
LEASE_S = 3.0
TRANSFER_TIMEOUT_S = 4.0
TIMEOUT = httpx.Timeout(60.0)
# The tiny checkpoint (tests/helpers.py): 2 layers, 2 KV heads of 16, float32.
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4


@pytest.fixture(scope="module")
def checkpoint() -> str:
    return make_checkpoint("llama")


@contextlib.contextmanager
def _env(**kv: str):
    old = {k: os.environ.get(k) for k in kv}
    os.environ.update(kv)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def cluster(checkpoint: str):
    """ref (both), prefill (per-transfer fault injection), decode, decode with the fail
    fallback, a spare prefill to kill; booted side by side; and the proxy."""
    with contextlib.ExitStack() as stack:
        def prefill(*extra: str) -> tuple[ServerProcess, int]:
            port = free_port()
            with _env(CONVEYOR_KV_FAULT="per-transfer"):
                s = stack.enter_context(serve(
                    checkpoint, *COMMON, "--kv-role", "prefill", "--kv-port", str(port),
                    "--kv-lease-timeout", str(LEASE_S), *extra, wait=False))
            return s, port

        ref = stack.enter_context(serve(checkpoint, *COMMON, wait=False))
        pre, pre_port = prefill()
        spare, spare_port = prefill()
        dec = stack.enter_context(serve(
            checkpoint, *COMMON, "--kv-role", "decode",
            "--kv-transfer-timeout", str(TRANSFER_TIMEOUT_S), wait=False))
        dec_fail = stack.enter_context(serve(
            checkpoint, *COMMON, "--kv-role", "decode", "--kv-transfer-fallback", "fail",
            "--kv-transfer-timeout", str(TRANSFER_TIMEOUT_S), wait=False))
        for s in (ref, pre, spare, dec, dec_fail):
            s.wait_ready(180.0)
        proxy = stack.enter_context(router([], "--prefill", pre.url, "--decode", dec.url))
        yield dict(ref=ref, pre=pre, pre_port=pre_port, spare=spare, spare_port=spare_port,
                   dec=dec, dec_fail=dec_fail, proxy=proxy)


def _metric(server: ServerProcess, name: str) -> float:
    return server.metrics().get("conveyor:" + name, 0.0)


def _baseline(*servers: ServerProcess) -> None:
    """Every KV pool back to all free (no request, no lease, no load holds a block)."""
    for s in servers:
        wait_for(lambda s=s: _metric(s, "kv_cache_free_blocks") == NUM_BLOCKS,
                 timeout_s=LEASE_S + TRANSFER_TIMEOUT_S + 10, what=f"{s.url} pool baseline")


def _completion(url: str, prompt: list[int], timeout=TIMEOUT, **kw) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "logprobs": 1,
            "ignore_eos": True, "temperature": 0.0, **kw}  # greedy unless told
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


def _tokens(r: httpx.Response) -> tuple[str, list[str]]:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["tokens"]


def _prefill_handle(pre: ServerProcess, prompt: list[int], transfer_id: str, **kw) -> dict:
    r = _completion(pre.url, prompt, max_tokens=1,
                    kv_transfer_params={"transfer_id": transfer_id, "do_remote_decode": True},
                    **kw)
    assert r.status_code == 200, r.text
    handle = r.json()["kv_transfer_params"]
    assert handle["transfer_id"] == transfer_id and handle["num_prompt_tokens"] == len(prompt)
    return handle


SAMPLING = [dict(temperature=0.0), dict(temperature=0.9, top_p=0.95, seed=1234)]


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
def test_outputs_equal_single_engine(cluster, sampling):
    ref, proxy, dec = cluster["ref"], cluster["proxy"], cluster["dec"]
    loads = _metric(dec, "kv_transfer_loads_total")
    recomputed = _metric(dec, "kv_transfer_requests_recomputed_total")
    prompts = random_prompts(3, lo=9, hi=40, seed=7)
    for prompt in prompts:
        want = _tokens(_completion(ref.url, prompt, **sampling))
        got = _tokens(_completion(proxy.url, prompt, **sampling))
        assert got == want
    # Through the transfer, not the fallback: every prompt's K/V was pulled.
    assert _metric(dec, "kv_transfer_loads_total") == loads + len(prompts)
    assert _metric(dec, "kv_transfer_requests_recomputed_total") == recomputed
    _baseline(cluster["pre"], dec)


def test_stream_relayed_and_chat(cluster):
    ref, proxy = cluster["ref"], cluster["proxy"]
    prompt = random_prompts(1, lo=20, hi=20, seed=3)[0]
    want, _ = _tokens(_completion(ref.url, prompt))
    text = ""
    with httpx.stream("POST", proxy.url + "/v1/completions", timeout=TIMEOUT,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 10,
                            "ignore_eos": True, "stream": True, "temperature": 0.0}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 2  # (deltas may coalesce under load)
    for e in events[:-1]:
        text += json.loads(e)["choices"][0]["text"]
    assert text == want
    msgs = [{"role": "user", "content": "hello there"}]
    chat = [httpx.post(u + "/v1/chat/completions", timeout=TIMEOUT,
                       json={"model": MODEL, "messages": msgs, "max_tokens": 8,
                             "temperature": 0.0}).json()["choices"][0]["message"]["content"]
            for u in (ref.url, proxy.url)]
    assert chat[0] == chat[1]


def test_bytes_blocks_and_prompt_tokens_exact(cluster):
    pre, dec, proxy = cluster["pre"], cluster["dec"], cluster["proxy"]
    names = ("kv_transfer_bytes_sent_total", "kv_transfer_blocks_sent_total")
    dnames = ("kv_transfer_bytes_received_total", "kv_transfer_blocks_received_total",
              "prompt_tokens_computed_total", "kv_transfer_loads_total")
    before = [_metric(pre, n) for n in names] + [_metric(dec, n) for n in dnames]
    prompt = random_prompts(1, lo=37, hi=37, seed=11)[0]
    assert _completion(proxy.url, prompt).status_code == 200
    _baseline(pre, dec)  # the lease ended by the decode engine's done
    after = [_metric(pre, n) for n in names] + [_metric(dec, n) for n in dnames]
    delta = [a - b for a, b in zip(after, before)]
    nbytes = KV_BYTES_PER_TOKEN * len(prompt)  # 2 x layers x tokens x kv heads x dim x 4
    nblocks = -(-len(prompt) // BLOCK)
    assert delta == [nbytes, nblocks, nbytes, nblocks, 1, 1]
    assert _metric(pre, "kv_transfer_leases_released_total") >= 1


def test_killed_prefill_mid_transfer_recomputes(cluster):
    """The spare prefill answers, its pull is held (fault delay), it is killed meanwhile:
    the decode engine times out and computes the prompt itself; the answer is right."""
    ref, spare, dec = cluster["ref"], cluster["spare"], cluster["dec"]
    prompt = random_prompts(1, lo=30, hi=30, seed=5)[0]
    want = _tokens(_completion(ref.url, prompt))
    handle = _prefill_handle(spare, prompt, f"fault-delay-30-{uuid.uuid4().hex}")
    recomputed = _metric(dec, "kv_transfer_requests_recomputed_total")
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=_completion(
        dec.url, prompt, kv_transfer_params=handle)))
    t.start()
    wait_for(lambda: _metric(dec, "kv_transfer_loads_in_flight") == 1, what="load started")
    _kill_tree(spare)
    t.join(timeout=TRANSFER_TIMEOUT_S + 30)
    assert not t.is_alive()
    assert _tokens(result["r"]) == want
    assert _metric(dec, "kv_transfer_requests_recomputed_total") == recomputed + 1
    _baseline(dec)


def test_prefill_slower_than_its_lease(cluster):
    """The pull's answer comes after the lease expired: the prefill frees the blocks at
    the lease, the decode engine gives up and recomputes; both pools back to baseline."""
    ref, pre, dec = cluster["ref"], cluster["pre"], cluster["dec"]
    prompt = random_prompts(1, lo=25, hi=25, seed=6)[0]
    want = _tokens(_completion(ref.url, prompt))
    expired = _metric(pre, "kv_transfer_leases_expired_total")
    failed = _metric(dec, "kv_transfer_failed_total")
    handle = _prefill_handle(pre, prompt, f"fault-delay-{LEASE_S + 3}-{uuid.uuid4().hex}")
    assert _tokens(_completion(dec.url, prompt, kv_transfer_params=handle)) == want
    _baseline(pre, dec)
    assert _metric(pre, "kv_transfer_leases_expired_total") == expired + 1
    assert _metric(dec, "kv_transfer_failed_total") == failed + 1


def test_dropped_reply_recomputes(cluster):
    ref, pre, dec = cluster["ref"], cluster["pre"], cluster["dec"]
    prompt = random_prompts(1, lo=18, hi=18, seed=8)[0]
    want = _tokens(_completion(ref.url, prompt, temperature=0.9, seed=99))
    handle = _prefill_handle(pre, prompt, f"fault-drop-{uuid.uuid4().hex}")
    got = _tokens(_completion(dec.url, prompt, kv_transfer_params=handle,
                              temperature=0.9, seed=99))
    assert got == want
    _baseline(pre, dec)


def test_fail_fallback_is_a_clear_error(cluster):
    pre, dec_fail = cluster["pre"], cluster["dec_fail"]
    prompt = random_prompts(1, lo=18, hi=18, seed=9)[0]
    handle = _prefill_handle(pre, prompt, f"fault-drop-{uuid.uuid4().hex}")
    r = _completion(dec_fail.url, prompt, kv_transfer_params=handle)
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_transfer_failed" and "KV transfer" in err["message"]
    assert _metric(dec_fail, "kv_transfer_requests_failed_total") == 1
    _baseline(pre, dec_fail)


def test_client_leaves_mid_transfer(cluster):
    """A decode request whose K/V is held back is abandoned by its client: the decode
    engine frees the loading blocks at once, the prefill's lease ends; others are served
    meanwhile (the waiting request blocks nobody)."""
    ref, pre, dec = cluster["ref"], cluster["pre"], cluster["dec"]
    prompt = random_prompts(1, lo=30, hi=30, seed=10)[0]
    handle = _prefill_handle(pre, prompt, f"fault-delay-{LEASE_S + 3}-{uuid.uuid4().hex}")
    with contextlib.suppress(httpx.TimeoutException):
        _completion(dec.url, prompt, kv_transfer_params=handle,
                    timeout=httpx.Timeout(60.0, read=1.0))
    other = random_prompts(1, lo=12, hi=12, seed=12)[0]
    assert _tokens(_completion(dec.url, other)) == _tokens(_completion(ref.url, other))
    wait_for(lambda: _metric(dec, "kv_transfer_loads_in_flight") == 0, what="load cancelled")
    _baseline(pre, dec)


def test_bad_handles_are_400(cluster):
    dec, ref = cluster["dec"], cluster["ref"]
    prompt = [5, 6, 7]
    r = _completion(dec.url, prompt, kv_transfer_params={"transfer_id": "x"})
    assert r.status_code == 400 and "exactly one" in r.json()["error"]["message"]
    r = _completion(ref.url, prompt, kv_transfer_params={"transfer_id": "x",
                                                         "do_remote_decode": True})
    assert r.status_code == 400 and "--kv-role" in r.json()["error"]["message"]


def _kill_tree(server: ServerProcess) -> None:
    """kill -9 the server and its engine-core process (which runs the KV server)."""
    from server_helpers import engine_core_pid

    with contextlib.suppress(RuntimeError, ProcessLookupError):
        os.kill(engine_core_pid(server), signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=30)
