"""The prefill/decode proxy: one OpenAI-compatible endpoint over prefill and decode engines.

    POST /v1/completions, /v1/chat/completions
        1. to a prefill engine (``--kv-role prefill``): the same body with max_tokens 1, no
           stream, ``kv_transfer_params = {transfer_id, do_remote_decode}``; its response
           carries the handle (where to pull, the prompt's length)
        2. to a decode engine (``--kv-role decode``): the client's body plus that handle;
           its answer (JSON, or SSE chunk by chunk) goes to the client as it is
    GET /v1/models       a decode engine's answer
    GET /health          200 while some prefill and some decode engine answer /health

It only translates HTTP: the engines own the transfer (docs/disaggregation.md). Each
stage picks the engine with the fewest requests in flight through this proxy. Errors
become OpenAI-format errors: a prefill engine's own error (a 400, a 429) is relayed as
it is; a prefill engine that cannot be reached sends the request to a decode engine
without a handle (it computes the prompt itself, counted in ``/router/stats``); a
decode engine that fails is a 502. A client that leaves closes the upstream connection,
so the engine aborts the request (the decode engine frees blocks still loading).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from conveyor.entrypoints.openai.errors import OpenAIError
from conveyor.entrypoints.openai.serving_common import ClientDisconnected, until_disconnected
from conveyor.router.app import _HOP_HEADERS, _ClosingStreamingResponse, _read_raw

logger = logging.getLogger("conveyor.router")


@dataclass(frozen=True)
class DisaggConfig:
    prefill: Sequence[str]
    decode: Sequence[str]
    connect_timeout_s: float = 2.0
    request_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("give at least one --prefill URL and one --decode URL")
        urls = [*self.prefill, *self.decode]
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"an engine is an http:// or https:// URL, got {url!r}")
        if len(set(urls)) != len(urls):
            raise ValueError(f"an engine is listed twice: {urls}")


@dataclass
class _Engine:
    url: str
    in_flight: int = 0


@dataclass
class ProxyStats:
    requests: int = 0
    prefill_errors: int = 0  # a prefill engine answered an error (relayed)
    prefill_unreachable: int = 0  # sent to a decode engine without a handle
    decode_errors: int = 0
    by_engine: dict[str, int] = field(default_factory=dict)


class DisaggProxy:
    def __init__(self, config: DisaggConfig,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self.prefill = [_Engine(u.rstrip("/")) for u in config.prefill]
        self.decode = [_Engine(u.rstrip("/")) for u in config.decode]
        self.stats = ProxyStats()
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            transport=transport)

    @staticmethod
    def _pick(engines: list[_Engine]) -> _Engine:
        return min(engines, key=lambda e: e.in_flight)  # ties: the first listed

    async def handle(self, request: Request, path: str) -> Response:
        self.stats.requests += 1
        try:
            payload = json.loads(await request.body())
        except ValueError:
            return _error(OpenAIError(400, "the body is not valid JSON"))
        if not isinstance(payload, dict):
            return _error(OpenAIError(400, "the body must be a JSON object"))
        if payload.get("kv_transfer_params") is not None:
            return _error(OpenAIError(400, "kv_transfer_params is set by the proxy",
                                      param="kv_transfer_params"))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        headers.pop("content-type", None)
        handle = await self._prefill(request, path, payload, headers)
        if isinstance(handle, Response):
            return handle
        body = dict(payload)
        if handle is not None:
            body["kv_transfer_params"] = handle
        return await self._decode(request, path, body, headers)

    async def _prefill(self, request: Request, path: str, payload: dict,
                       headers: dict[str, str]) -> dict | Response | None:
        """The handle, an error response to relay, or None (no prefill engine reachable:
        the decode engine computes the prompt)."""
        body = dict(payload, max_tokens=1, stream=False,
                    kv_transfer_params={"transfer_id": uuid.uuid4().hex,
                                        "do_remote_decode": True})
        body.pop("stream_options", None)
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        engine = self._pick(self.prefill)
        engine.in_flight += 1
        try:
            r = await until_disconnected(
                request, self.client.post(engine.url + path, json=body, headers=headers))
        except ClientDisconnected:
            return Response(status_code=499)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            self.stats.prefill_unreachable += 1
            logger.warning("prefill engine %s unreachable (%s): the decode engine computes "
                           "the prompt", engine.url, e)
            return None
        except httpx.HTTPError as e:
            self.stats.prefill_errors += 1
            return _error(OpenAIError(502, f"prefill engine {engine.url} failed: "
                                           f"{type(e).__name__}: {e}", code="prefill_failed",
                                      err_type="server_error"))
        finally:
            engine.in_flight -= 1
        if r.status_code != 200:  # the engine's own OpenAI error: the client's to read
            self.stats.prefill_errors += 1
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        try:
            handle = r.json()["kv_transfer_params"]
        except (ValueError, KeyError, TypeError):
            self.stats.prefill_errors += 1
            return _error(OpenAIError(502, f"prefill engine {engine.url} answered without "
                                           f"kv_transfer_params (is it --kv-role prefill?)",
                                      code="prefill_failed", err_type="server_error"))
        return handle

    async def _decode(self, request: Request, path: str, body: dict,
                      headers: dict[str, str]) -> Response:
        engine = self._pick(self.decode)
        engine.in_flight += 1
        self.stats.by_engine[engine.url] = self.stats.by_engine.get(engine.url, 0) + 1
        upstream_req = self.client.build_request("POST", engine.url + path, json=body,
                                                 headers=headers)
        try:
            upstream = await until_disconnected(
                request, self.client.send(upstream_req, stream=True))
        except ClientDisconnected:
            engine.in_flight -= 1
            return Response(status_code=499)
        except httpx.HTTPError as e:
            engine.in_flight -= 1
            return self._decode_failed(engine, e)
        out_headers = {k: v for k, v in upstream.headers.items()
                       if k.lower() not in _HOP_HEADERS and k.lower() not in ("date", "server")}
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return _ClosingStreamingResponse(self._relay(upstream, engine),
                                             status_code=upstream.status_code,
                                             headers=out_headers)
        try:
            content = await until_disconnected(request, _read_raw(upstream))
        except ClientDisconnected:
            return Response(status_code=499)
        except httpx.HTTPError as e:
            return self._decode_failed(engine, e)
        finally:
            await upstream.aclose()
            engine.in_flight -= 1
        return Response(content, status_code=upstream.status_code, headers=out_headers)

    async def _relay(self, upstream: httpx.Response, engine: _Engine) -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            self.stats.decode_errors += 1
            err = OpenAIError(502, f"decode engine {engine.url} failed during the request: "
                                   f"{type(e).__name__}: {e}", code="decode_failed",
                              err_type="server_error")
            yield f"data: {json.dumps(err.body())}\n\n".encode()
        finally:
            await upstream.aclose()
            engine.in_flight -= 1

    def _decode_failed(self, engine: _Engine, e: Exception) -> JSONResponse:
        self.stats.decode_errors += 1
        return _error(OpenAIError(502, f"decode engine {engine.url} failed: "
                                       f"{type(e).__name__}: {e}", code="decode_failed",
                                  err_type="server_error"))

    async def healthy(self, engines: list[_Engine]) -> list[str]:
        async def one(e: _Engine) -> str | None:
            with contextlib.suppress(httpx.HTTPError):
                r = await self.client.get(e.url + "/health", timeout=2.0)
                if r.status_code == 200:
                    return e.url
            return None
        return [u for u in await asyncio.gather(*(one(e) for e in engines)) if u]


def _error(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def build_disagg_app(config: DisaggConfig,
                     transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    proxy = DisaggProxy(config, transport)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await proxy.client.aclose()

    app = FastAPI(title="conveyor router (prefill/decode)", lifespan=lifespan)
    app.state.proxy = proxy

    @app.get("/health")
    async def health() -> Response:
        pre, dec = await proxy.healthy(proxy.prefill), await proxy.healthy(proxy.decode)
        body = {"prefill": pre, "decode": dec}
        if pre and dec:
            return JSONResponse({"status": "ok", **body})
        return JSONResponse({**OpenAIError(503, "no prefill or no decode engine answers "
                                                "/health", code="no_engine_available").body(),
                             **body}, status_code=503)

    @app.get("/router/stats")
    async def stats() -> JSONResponse:
        s = proxy.stats
        return JSONResponse({"requests": s.requests, "prefill_errors": s.prefill_errors,
                             "prefill_unreachable": s.prefill_unreachable,
                             "decode_errors": s.decode_errors, "by_decode_engine": s.by_engine})

    @app.get("/v1/models")
    async def models() -> Response:
        try:
            r = await proxy.client.get(proxy._pick(proxy.decode).url + "/v1/models")
        except httpx.HTTPError as e:
            return _error(OpenAIError(502, f"decode engine failed: {e}", code="decode_failed"))
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.handle(request, "/v1/chat/completions")

    return app
