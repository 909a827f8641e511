"""The data-parallel router: a FastAPI proxy in front of N ``conveyor serve`` replicas.

    POST /v1/completions, /v1/chat/completions   routed by the policy, relayed unchanged
                                                 (SSE chunk by chunk)
    POST /tokenize, /detokenize                  to the least-loaded replica
    GET  /v1/models                              a replica's answer
    GET  /health                                 200 while a replica is in rotation, else 503
    GET  /router/replicas                        each replica's state (JSON)

The handlers only translate HTTP: the choice is ``policies``, the replicas' state
``health``. For prefix routing the router needs the prompt's token ids; it asks a
replica's own ``POST /tokenize`` (the same tokenizer, chat template and template flags
that replica will use, so the hashes match its cache, and the router needs no copy of
the checkpoint), at the price of one loopback round trip per request.

Failures: a failed connect takes that replica out of rotation and the request goes to
another (nothing reached the first); a replica that fails after the request was sent
fails that request alone, 502 with an OpenAI error body (in a stream that has begun,
an error event), and leaves rotation until its health check passes; past
``--request-timeout`` a request fails with a 504 and its connection is closed (the
replica aborts it), the replica staying in rotation; no replica in rotation is a 503.
A client that leaves closes the replica's connection, streamed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from conveyor.entrypoints.openai.errors import OpenAIError
from conveyor.entrypoints.openai.serving_common import ClientDisconnected, until_disconnected
from conveyor.router.health import HealthChecker, Replica
from conveyor.router.policies import (
    Policy,
    RoutingRequest,
    least_loaded,
    make_policy,
    serving_model,
)

logger = logging.getLogger("conveyor.router")

# Headers that describe one hop's connection or body, not the message (RFC 9110 7.6.1).
_HOP_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive",
                          "transfer-encoding", "te", "trailer", "upgrade",
                          "proxy-authorization", "proxy-connection"})


@dataclass(frozen=True)
class RouterConfig:
    replicas: Sequence[str]
    routing: str = "prefix"
    health_interval_s: float = 1.0
    health_timeout_s: float = 5.0
    connect_timeout_s: float = 2.0
    summary_blocks: int = 8192
    replica_api_key: str | None = None
    # A request not answered (or, streamed, not finished) in this long fails with a 504:
    # what bounds a replica that stalls without closing its connections.
    request_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("give at least one --replica URL")
        for url in self.replicas:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"a replica is an http:// or https:// URL, got {url!r}")
        if len(set(self.replicas)) != len(self.replicas):
            raise ValueError(f"a replica is listed twice: {list(self.replicas)}")
        make_policy(self.routing)  # an unknown name fails here
        if self.connect_timeout_s <= 0:
            raise ValueError(f"connect timeout must be > 0, got {self.connect_timeout_s}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"request timeout must be > 0, got {self.request_timeout_s}")


class Router:
    """The state behind the app: replicas, the policy, the HTTP client, the checker."""

    def __init__(self, config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None
                 ) -> None:
        self.config = config
        self.replicas = [Replica(url.rstrip("/")) for url in config.replicas]
        self.policy: Policy = make_policy(config.routing)
        headers = ({"Authorization": f"Bearer {config.replica_api_key}"}
                   if config.replica_api_key else None)
        # No read timeout: a generation may take minutes; a replica that dies closes the
        # connection (an error at once), one that stalls is --request-timeout's job.
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            headers=headers, transport=transport)
        self.checker = HealthChecker(self.replicas, self.client,
                                     interval_s=config.health_interval_s,
                                     timeout_s=config.health_timeout_s,
                                     summaries=self.policy.needs_hashes,
                                     summary_blocks=config.summary_blocks)

    def in_rotation(self, exclude: Sequence[Replica] = ()) -> list[Replica]:
        return [r for r in self.replicas if r.healthy and r not in exclude]

    # ---- what the policy needs -----------------------------------------------------------
    async def routing_request(self, path: str, payload: object,
                              headers: dict[str, str]) -> RoutingRequest:
        """The prompt's token ids for prefix routing (via a replica's /tokenize), else
        nothing: a request the router cannot read goes by load, and the replica answers
        its error."""
        if not self.policy.needs_hashes or not isinstance(payload, dict):
            return RoutingRequest(None)
        tok: dict = {"model": payload.get("model")}
        if path == "/v1/chat/completions":
            tok["messages"] = payload.get("messages")
            for key in ("add_generation_prompt", "chat_template_kwargs"):
                if payload.get(key) is not None:
                    tok[key] = payload[key]
        else:
            prompt = payload.get("prompt")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # a batch: the first prompt decides
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return RoutingRequest(list(prompt))
            if not isinstance(prompt, str):
                return RoutingRequest(None)
            tok["prompt"] = prompt
        replicas = self.in_rotation()
        if not replicas:
            return RoutingRequest(None)
        replica = replicas[least_loaded(replicas)]
        try:
            r = await self.client.post(replica.url + "/tokenize", json=tok,
                                       headers=_auth_only(headers))
            if r.status_code == 200:
                return RoutingRequest(list(r.json()["tokens"]))
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            logger.warning("tokenize on %s failed (%s): routing by load", replica.url, e)
        return RoutingRequest(None)

    # ---- forwarding ----------------------------------------------------------------------
    async def forward(self, request: Request, path: str, route: bool) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        payload: object = None
        if route:  # (the model for adapter affinity, the prompt for prefix routing)
            with contextlib.suppress(ValueError):
                payload = json.loads(body)
        rreq = (await self.routing_request(path, payload, headers) if route
                else RoutingRequest(None))
        if isinstance(payload, dict) and isinstance(payload.get("model"), str):
            rreq.model = payload["model"]
        loop = asyncio.get_running_loop()
        timeout = self.config.request_timeout_s
        deadline = None if timeout is None else loop.time() + timeout
        tried: list[Replica] = []
        while True:
            candidates = serving_model(self.in_rotation(exclude=tried), rreq.model)
            if not candidates:
                return _error(503, _no_replica_message(self.replicas),
                              "no_replica_available")
            replica = candidates[self.policy.choose(rreq, candidates) if route
                                 else least_loaded(candidates)]
            charged = replica.begin(rreq)
            upstream_req = self.client.build_request(
                request.method, replica.url + path, content=body, headers=headers,
                params=request.query_params)
            try:
                # A non-streamed answer comes whole: a client that leaves meanwhile closes
                # the replica's connection, so the replica aborts the request too.
                async with asyncio.timeout_at(deadline):
                    upstream = await until_disconnected(
                        request, self.client.send(upstream_req, stream=True))
            except ClientDisconnected:
                replica.end(charged)
                return Response(status_code=499)
            except TimeoutError:
                replica.end(charged)
                return self._timed_out(replica)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                # Nothing reached the replica: out of rotation now, try another.
                replica.end(charged)
                replica.mark_down(f"connect failed: {type(e).__name__}: {e}")
                tried.append(replica)
                continue
            except httpx.HTTPError as e:
                replica.end(charged)
                return self._failed(replica, e)
            break
        # The body goes as the replica sent it (raw bytes, its content-encoding kept); the
        # router's server writes its own date and server headers.
        out_headers = {k: v for k, v in upstream.headers.items()
                       if k.lower() not in _HOP_HEADERS and k.lower() not in ("date", "server")}
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return _ClosingStreamingResponse(self._relay(upstream, replica, charged, deadline),
                                             status_code=upstream.status_code,
                                             headers=out_headers)
        try:
            async with asyncio.timeout_at(deadline):
                content = await until_disconnected(request, _read_raw(upstream))
        except ClientDisconnected:
            return Response(status_code=499)
        except TimeoutError:
            return self._timed_out(replica)
        except httpx.HTTPError as e:
            return self._failed(replica, e)
        finally:
            await upstream.aclose()
            replica.end(charged)
        return Response(content, status_code=upstream.status_code, headers=out_headers)

    async def _relay(self, upstream: httpx.Response, replica: Replica, charged: int,
                     deadline: float | None) -> AsyncIterator[bytes]:
        """The replica's SSE bytes as they come; a replica that fails midway, or a stream
        past the deadline, ends with an OpenAI error event."""
        chunks = upstream.aiter_raw()
        try:
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                yield chunk
        except httpx.HTTPError as e:
            err = self._error_of(replica, e)
            yield f"data: {json.dumps(err.body())}\n\n".encode()
        except TimeoutError:
            yield f"data: {json.dumps(self._timeout_error(replica).body())}\n\n".encode()
        finally:
            await upstream.aclose()
            replica.end(charged)

    def _error_of(self, replica: Replica, e: Exception) -> OpenAIError:
        replica.num_failed += 1
        replica.mark_down(f"request failed: {type(e).__name__}: {e}")
        return OpenAIError(502, f"replica {replica.url} failed during the request: "
                                f"{type(e).__name__}: {e}", code="replica_failed",
                           err_type="server_error")

    def _timeout_error(self, replica: Replica) -> OpenAIError:
        replica.num_failed += 1
        return OpenAIError(504, f"replica {replica.url} did not finish the request within "
                                f"--request-timeout {self.config.request_timeout_s:g} s",
                           code="replica_timeout", err_type="timeout_error")

    def _timed_out(self, replica: Replica) -> JSONResponse:
        err = self._timeout_error(replica)
        logger.warning("%s", err.message)
        return JSONResponse(err.body(), status_code=504)

    def _failed(self, replica: Replica, e: Exception) -> JSONResponse:
        err = self._error_of(replica, e)
        return JSONResponse(err.body(), status_code=err.status)


class _ClosingStreamingResponse(StreamingResponse):
    """Closes the relay when the response ends, so that a client that leaves closes the
    upstream connection now (the replica then aborts the request)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


async def _read_raw(response: httpx.Response) -> bytes:
    if response.is_stream_consumed:  # a response made whole in memory (a mock transport)
        return response.content
    return b"".join([chunk async for chunk in response.aiter_raw()])


def _auth_only(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() == "authorization"}


def _error(status: int, message: str, code: str) -> JSONResponse:
    err = OpenAIError(status, message, code=code)
    return JSONResponse(err.body(), status_code=status)


def _no_replica_message(replicas: Sequence[Replica]) -> str:
    why = "; ".join(f"{r.url}: {r.reason}" for r in replicas)
    return f"no replica is in rotation ({why})"


def build_router_app(config: RouterConfig,
                     transport: httpx.AsyncBaseTransport | None = None,
                     on_stop: Callable[[], None] | None = None) -> FastAPI:
    """``on_stop`` runs (in a thread) when the app stops: uvicorn re-raises the signal
    that stopped it once it returns, so code after ``uvicorn.run`` may never run."""
    router = Router(config, transport)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.checker.check_all()  # replicas that are up serve from the start
        task = asyncio.create_task(router.checker.run())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await router.client.aclose()
            if on_stop is not None:
                await asyncio.to_thread(on_stop)

    app = FastAPI(title="conveyor router", lifespan=lifespan)
    app.state.router = router

    @app.get("/health")
    async def health() -> Response:
        if router.in_rotation():
            return JSONResponse({"status": "ok",
                                 "replicas": [r.state() for r in router.replicas]})
        return _error(503, _no_replica_message(router.replicas), "no_replica_available")

    @app.get("/router/replicas")
    async def replicas() -> JSONResponse:
        return JSONResponse({"routing": router.policy.name,
                             "replicas": [r.state() for r in router.replicas]})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.forward(request, "/v1/models", route=False)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.forward(request, "/v1/completions", route=True)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await router.forward(request, "/v1/chat/completions", route=True)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await router.forward(request, "/tokenize", route=False)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await router.forward(request, "/detokenize", route=False)

    return app
