"""The server app in-process (httpx's ASGI transport): faults injected into one request's
handling, a dead engine loop, scheduling hints reaching the engine, and the sandboxed chat
template."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import tempfile
import threading
from collections.abc import AsyncIterator

import httpx
import pytest

from conveyor.config import EngineArgs
from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.core import EngineCore
from conveyor.engine.llm_engine import LLMEngine
from conveyor.engine.messages import UtilityMethod
from conveyor.entrypoints.openai import serving_completion
from conveyor.entrypoints.openai.api_server import build_app, make_state
from conveyor.entrypoints.openai.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    find_chat_template,
)
from conveyor.entrypoints.openai.serving_common import ServerState

from helpers import cpu_threads, make_checkpoint
from server_helpers import ATTENTION_BACKEND


@contextlib.asynccontextmanager
async def app_client(engine_kw: dict | None = None, **state_kw
                     ) -> AsyncIterator[tuple[httpx.AsyncClient, ServerState]]:
    """The server app in-process (httpx's ASGI transport) around a thread engine;
    ``engine_kw`` are engine options, ``state_kw`` server options."""
    args = EngineArgs(model=make_checkpoint("llama"), dtype="float32",
                      num_threads=cpu_threads(), num_kv_blocks=64, block_size=8,
                      attention_backend=ATTENTION_BACKEND, **(engine_kw or {}))
    engine = AsyncEngine(LLMEngine(args))
    state = make_state(engine, **state_kw)
    app = build_app(state)
    engine.start()  # the ASGI transport does not run the lifespan
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, state
    finally:
        await engine.shutdown()


async def free_blocks(state: ServerState) -> int:
    return await state.engine.utility(UtilityMethod.NUM_FREE_BLOCKS)


def completion(prompt: str, **kw) -> dict:
    return {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **kw}


def test_an_exception_in_one_request_fails_that_request_only(monkeypatch) -> None:
    real_response = serving_completion._response

    def flaky_response(req, *args, **kwargs):
        if req.prompt == "ba boom":
            raise RuntimeError("formatting bug")
        return real_response(req, *args, **kwargs)

    monkeypatch.setattr(serving_completion, "_response", flaky_response)

    async def main() -> None:
        async with app_client() as (client, state):
            start = await free_blocks(state)
            results = await asyncio.gather(
                client.post("/v1/completions", json=completion("ba be")),
                client.post("/v1/completions", json=completion("ba boom")),
                client.post("/v1/completions", json=completion("di do")))
            assert [r.status_code for r in results] == [200, 500, 200]
            error = results[1].json()["error"]
            assert error["type"] == "server_error" and "formatting bug" in error["message"]
            assert all(r.json()["usage"]["completion_tokens"] == 6
                       for r in (results[0], results[2]))
            assert await free_blocks(state) == start
            assert (await client.get("/health")).status_code == 200

    asyncio.run(main())


def test_an_exception_mid_stream_ends_that_stream_with_an_error_event(monkeypatch) -> None:
    real_build = serving_completion._LogprobsBuilder.build
    calls = 0

    def flaky_build(self, c):
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("logprobs bug")
        return real_build(self, c)

    monkeypatch.setattr(serving_completion._LogprobsBuilder, "build", flaky_build)

    async def main() -> None:
        async with app_client() as (client, state):
            start = await free_blocks(state)
            broken, fine = await asyncio.gather(
                client.post("/v1/completions",
                            json=completion("ba be", max_tokens=50, logprobs=1, stream=True)),
                client.post("/v1/completions",
                            json=completion("di do", stream=True,
                                            stream_options={"include_usage": True})))
            events = [e for e in broken.text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2][len("data: "):])["error"]
            assert "logprobs bug" in error["message"]
            assert len(events) < 50  # it stopped early
            fine_events = [json.loads(e[len("data: "):])
                           for e in fine.text.split("\n\n") if e and "[DONE]" not in e]
            assert "error" not in fine_events[-1]
            assert fine_events[-1]["usage"]["completion_tokens"] == 6
            assert fine_events[-2]["choices"][0]["finish_reason"] == "length"
            assert await free_blocks(state) == start

    asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_aborts_its_request(monkeypatch, stream: bool) -> None:
    """Deterministic, whatever the machine's speed: after the request's first step the engine
    is held until the server has sent the abort, so the request cannot finish first; the
    client leaves while it is held."""
    held, aborted = threading.Event(), threading.Event()
    real_step = EngineCore.step

    def held_step(self):
        outs = real_step(self)
        if self.has_unfinished_requests() and not aborted.is_set():
            held.set()
            assert aborted.wait(30), "the server never aborted the disconnected request"
        return outs

    monkeypatch.setattr(EngineCore, "step", held_step)
    real_abort = AsyncEngine.abort_nowait

    def abort_and_release(self, request_id):
        real_abort(self, request_id)
        aborted.set()  # the Abort is queued: the engine drains it before its next step

    monkeypatch.setattr(AsyncEngine, "abort_nowait", abort_and_release)

    async def main() -> None:
        async with app_client() as (_client, state):
            start = await free_blocks(state)
            body = json.dumps(completion("ba be bi", max_tokens=450, stream=stream)).encode()
            sent: list[dict] = []
            delivered = False

            async def receive() -> dict:
                nonlocal delivered
                if not delivered:
                    delivered = True
                    return {"type": "http.request", "body": body, "more_body": False}
                await asyncio.get_running_loop().run_in_executor(None, held.wait, 30)
                return {"type": "http.disconnect"}  # the client goes away mid-generation

            async def send(message: dict) -> None:
                sent.append(message)

            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                     "method": "POST", "scheme": "http", "path": "/v1/completions",
                     "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
                     "headers": [(b"content-type", b"application/json"),
                                 (b"content-length", str(len(body)).encode())],
                     "client": ("127.0.0.1", 1), "server": ("test", 80)}
            await build_app(state)(scope, receive, send)
            assert aborted.is_set()
            finished = [(m.finish_reason, m.num_generation_tokens)
                        for m in state.engine.finished_metrics]
            assert len(finished) == 1
            reason, generated = finished[0]
            assert reason == "abort" and generated < 450, (reason, generated)
            assert await free_blocks(state) == start
            if not stream:
                assert not any(m.get("status") == 200 for m in sent)  # no answer to nobody

    asyncio.run(main())


def test_health_is_503_once_the_engine_loop_has_stopped() -> None:
    async def main() -> None:
        async with app_client() as (client, state):
            assert (await client.get("/health")).status_code == 200
            await state.engine.shutdown()
            r = await client.get("/health")
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            r = await client.post("/v1/completions", json=completion("ba"))
            assert r.status_code == 503
            assert (await client.get("/metrics")).status_code == 200

    asyncio.run(main())


def test_scheduling_hints_reach_the_engine() -> None:
    async def main() -> None:
        async with app_client() as (client, state):
            seen: list = []
            core = state.engine.core
            real_add = core.add_requests

            def spy(reqs):
                seen.extend(reqs)
                return real_add(reqs)

            core.add_requests = spy
            body = completion("ba be", priority=3, user="alice", expected_output_tokens=40,
                              slo_ttft_ms=250.0, slo_tpot_ms=20.0)
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200
            r = await client.post("/v1/chat/completions",
                                  json={"messages": [{"role": "user", "content": "ba"}],
                                        "max_tokens": 2, "user": "alice"},
                                  headers={"X-Tenant": "team-a"})
            assert r.status_code == 200
            completion_req, chat_req = seen
            assert completion_req.sampling_params.expected_output_tokens == 40
            assert (completion_req.priority, completion_req.tenant, completion_req.slo_ttft_ms,
                    completion_req.slo_tpot_ms) == (3, "alice", 250.0, 20.0)
            assert chat_req.tenant == "team-a"  # the gateway's header wins over the body
            tenants = [m.tenant for m in state.engine.finished_metrics]
            assert tenants == ["alice", "team-a"]

    asyncio.run(main())


def test_chat_without_a_template_is_a_clear_400() -> None:
    async def main() -> None:
        async with app_client() as (client, state):
            state.chat_template = None
            r = await client.post("/v1/chat/completions",
                                  json={"messages": [{"role": "user", "content": "ba"}]})
            assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"]

    asyncio.run(main())


# ---- chat templates ------------------------------------------------------------------------
def test_template_renders_like_transformers() -> None:
    from transformers import AutoTokenizer

    path = make_checkpoint("llama")
    tok = AutoTokenizer.from_pretrained(path)
    source = find_chat_template(path)
    assert source is not None
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ba"},
                {"role": "assistant", "content": "be"}, {"role": "user", "content": "bi"}]
    template = ChatTemplate(source, {"bos_token": tok.bos_token, "eos_token": tok.eos_token})
    for add in (True, False):
        assert template.render(messages, add_generation_prompt=add) == tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add)


@pytest.mark.parametrize("source", [
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__.__base__ }}",
    "{% set x = messages.append({'role': 'x'}) %}{{ x }}",
    "{{ cycler.__init__.__globals__ }}",
])
def test_template_sandbox_blocks_escapes(source: str) -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render([{"role": "user", "content": "hi"}])


def test_template_helpers_and_errors() -> None:
    source = ("{% for m in messages %}{% if m.role == 'tool' %}"
              "{{ raise_exception('no tools here') }}{% endif %}"
              "{{ bos_token }}{{ m | tojson }}{% endfor %}")
    template = ChatTemplate(source, {"bos_token": "<s>"})
    assert template.render([{"role": "user", "content": "<b>"}]) == \
        '<s>{"role": "user", "content": "<b>"}'
    with pytest.raises(ChatTemplateError, match="no tools here"):
        template.render([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="does not parse"):
        ChatTemplate("{% for %}")


def test_find_chat_template_sources() -> None:
    with tempfile.TemporaryDirectory() as d:
        assert find_chat_template(d) is None
        with open(os.path.join(d, "chat_template.jinja"), "w") as f:
            f.write("from-jinja-file")
        assert find_chat_template(d) == "from-jinja-file"
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump({"chat_template": [{"name": "tool_use", "template": "tools"},
                                         {"name": "default", "template": "named-default"}]}, f)
        assert find_chat_template(d) == "named-default"
        assert find_chat_template(d, "{{ override }}") == "{{ override }}"
        with pytest.raises(ValueError, match="neither a file nor a template"):
            find_chat_template(d, "no-such-file.jinja")


def test_serve_command_line() -> None:
    from conveyor.entrypoints.cli import build_parser
    from conveyor.entrypoints.serve import run

    args = build_parser().parse_args([
        "serve", "--model", "tiny", "--port", "9000", "--api-key", "k", "--max-queue-len", "3",
        "--request-timeout", "2.5", "--served-model-name", "x", "--max-num-seqs", "4",
        "--scheduling-policy", "fcfs", "--batching", "static", "--kv-cache-memory", "64M"])
    assert args.func is run
    assert (args.port, args.api_key, args.request_timeout) == (9000, "k", 2.5)
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.max_queue_len, engine_args.served_model_name, engine_args.max_num_seqs,
            engine_args.batching, engine_args.kv_cache_memory) == (3, "x", 4, "static", 64 << 20)
