"""The OpenAI-compatible HTTP server: FastAPI routes over an ``AsyncEngine``.

    GET  /health               200 while the engine loop runs, 503 otherwise (no auth)
    GET  /metrics              Prometheus text, prefix ``conveyor:``
    GET  /v1/kv_summary        cached prefix-block hashes and load, for ``conveyor router``
    GET  /v1/models
    GET  /version
    POST /v1/completions
    POST /v1/chat/completions
    POST /tokenize, /detokenize   (vLLM's)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   (vLLM's; with --enable-lora)

A body over ``--max-request-body-bytes`` is answered 413 before it is read whole or
parsed.

The server only translates HTTP to engine calls: request parsing and response
shapes live in ``protocol`` and the ``serving_*`` modules, scheduling and limits
in the engine. Uvicorn drains in-flight requests on SIGTERM/SIGINT before the
lifespan stops the engine loop.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from conveyor import __version__, envs
from conveyor.engine.async_engine import AsyncEngine
from conveyor.engine.core import KV_SUMMARY_DEFAULT_BLOCKS, KV_SUMMARY_MAX_BLOCKS
from conveyor.engine.messages import UtilityMethod
from conveyor.entrypoints.openai.chat_template import (
    ChatTemplate,
    find_chat_template,
    special_tokens_of,
)
from conveyor.entrypoints.openai.errors import OpenAIError, from_engine_error
from conveyor.entrypoints.openai.protocol import ModelCard, ModelList
from conveyor.entrypoints.openai.serving_chat import create_chat_completion
from conveyor.entrypoints.openai.serving_common import (
    DEFAULT_MAX_BODY_BYTES,
    ServerState,
    prompt_byte_cap,
)
from conveyor.entrypoints.openai.serving_completion import create_completion
from conveyor.entrypoints.openai.serving_lora import LoRARegistry, lora_body
from conveyor.entrypoints.openai.serving_tokens import detokenize, tokenize
from conveyor.metrics import CONTENT_TYPE, EngineMetrics

logger = logging.getLogger("conveyor.server")

API_KEY_ENV = envs.API_KEY
_OPEN_PATHS = frozenset({"/health"})


class BodySizeLimitMiddleware:
    """413 for a request body over ``max_bytes``: at once from its Content-Length, or as
    soon as a chunked body passes the limit (it is buffered up to the limit, then replayed).
    The limit applies before any JSON parsing or tokenization."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = OpenAIError(413, f"the request body is larger than {self.max_bytes} bytes "
                               "(--max-request-body-bytes)", code="request_too_large",
                          err_type="invalid_request_error")
        await JSONResponse(err.body(), status_code=413,
                           headers={"Connection": "close"})(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = self.max_bytes + 1
            if declared > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            await self.app(scope, receive, send)  # the server stops at Content-Length
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body was complete
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class APIKeyMiddleware:
    """Every route but /health needs ``Authorization: Bearer <key>``; 401 otherwise.

    Plain ASGI (not BaseHTTPMiddleware) so streaming and disconnects pass through untouched.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            err = OpenAIError(401, "missing or incorrect API key: send 'Authorization: Bearer "
                                   "<key>'", code="invalid_api_key")
            await JSONResponse(err.body(), status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        yield
        await state.engine.shutdown()

    app = FastAPI(title="conveyor", lifespan=lifespan)
    app.state.conveyor = state
    if state.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.api_key)
    # Added last, so it runs first: an oversized body is refused before anything else.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=state.max_body_bytes)
    state.engine.finish_listeners.append(state.metrics.observe_finished)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = OpenAIError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}")
        return JSONResponse(err.body(), status_code=exc.status_code)


    @app.get("/health")
    async def health() -> Response:
        if state.engine.is_alive:
            return JSONResponse({"status": "ok"})
        err = OpenAIError(503, f"the engine loop is not running: {state.engine.error!r}",
                          code="engine_dead")
        return JSONResponse(err.body(), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.engine.is_alive:
            state.metrics.update_stats(await state.engine.stats())
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/kv_summary")
    async def kv_summary(max_blocks: str | None = None) -> JSONResponse:
        limit = KV_SUMMARY_DEFAULT_BLOCKS
        if max_blocks is not None:
            try:
                limit = int(max_blocks)
            except ValueError:
                limit = -1
            if not 0 <= limit <= KV_SUMMARY_MAX_BLOCKS:
                raise OpenAIError(400, f"max_blocks must be an integer in [0, "
                                       f"{KV_SUMMARY_MAX_BLOCKS}], got {max_blocks!r}",
                                  param="max_blocks")
        try:
            summary = await state.engine.utility(UtilityMethod.KV_SUMMARY, limit)
        except Exception as e:
            raise from_engine_error(e) from None
        # Each adapter's id here: the router salts an adapter's prompt blocks with it.
        summary["lora_ids"] = ({name: r.lora_int_id for name, r in state.loras.adapters.items()}
                               if state.loras else {})
        return JSONResponse(summary)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = ModelCard(id=state.model_name, root=state.model_root,
                         max_model_len=state.max_model_len)
        adapters = [ModelCard(id=name, root=lora.lora_path, parent=state.model_name,
                              max_model_len=state.max_model_len)
                    for name, lora in (state.loras.adapters if state.loras else {}).items()]
        return JSONResponse(ModelList(data=[card, *adapters]).model_dump())

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw_request: Request) -> Response:
        name, path = lora_body(await _json(raw_request), "lora_name", "lora_path")
        _loras(state).load(name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw_request: Request) -> Response:
        (name,) = lora_body(await _json(raw_request), "lora_name")
        _loras(state).unload(name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.post("/tokenize")
    async def tokenize_route(raw_request: Request) -> Response:
        return await _guarded(tokenize(state, raw_request), raw_request)

    @app.post("/detokenize")
    async def detokenize_route(raw_request: Request) -> Response:
        return await _guarded(detokenize(state, raw_request), raw_request)

    @app.post("/v1/completions")
    async def completions(raw_request: Request) -> Response:
        return await _guarded(create_completion(state, raw_request), raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw_request: Request) -> Response:
        return await _guarded(create_chat_completion(state, raw_request), raw_request)

    return app


async def _json(raw_request: Request) -> object:
    try:
        return json.loads(await raw_request.body())
    except ValueError:
        raise OpenAIError(400, "the body is not valid JSON") from None


def _loras(state: ServerState) -> LoRARegistry:
    if state.loras is None:
        raise OpenAIError(400, "this server serves no LoRA adapters (start it with "
                               "--enable-lora)")
    return state.loras


async def _guarded(handler: Awaitable[Response], raw_request: Request) -> Response:
    """A bug in one request's handling fails that request alone, with a 500 error body."""
    try:
        return await handler
    except OpenAIError as e:
        return JSONResponse(e.body(), status_code=e.status)
    except Exception as e:
        logger.exception("%s %s failed", raw_request.method, raw_request.url.path)
        err = OpenAIError(500, f"internal error: {type(e).__name__}: {e}")
        return JSONResponse(err.body(), status_code=500)


def make_state(engine: AsyncEngine, *, api_key: str | None = None,
               request_timeout_s: float | None = None,
               chat_template: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               tool_call_parser: str | None = None,
               enable_auto_tool_choice: bool = False,
               reasoning_parser: str | None = None) -> ServerState:
    """Server state around an engine: model name, chat template, metrics registry."""
    import prometheus_client

    prometheus_client.disable_created_metrics()  # the *_created series are noise here
    cfg = engine.info.config.model
    tokenizer = engine.info.tokenizer
    source = find_chat_template(cfg.tokenizer, chat_template)
    template = ChatTemplate(source, special_tokens_of(tokenizer)) if source else None
    if request_timeout_s is not None and request_timeout_s <= 0:
        raise ValueError(f"--request-timeout must be > 0, got {request_timeout_s}")
    if max_body_bytes <= 0:
        raise ValueError(f"--max-request-body-bytes must be > 0, got {max_body_bytes}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    if tool_call_parser is not None:
        from conveyor.entrypoints.openai.tool_parsers import get_tool_parser

        get_tool_parser(tool_call_parser)  # an unknown name fails at start, not per request
    return ServerState(engine=engine, model_name=cfg.served_model_name, model_root=cfg.path,
                       max_model_len=engine.info.max_model_len,
                       metrics=EngineMetrics(engine.info.max_model_len),
                       chat_template=template, request_timeout_s=request_timeout_s,
                       api_key=api_key, max_body_bytes=max_body_bytes,
                       max_prompt_bytes=prompt_byte_cap(tokenizer, engine.info.max_model_len),
                       tool_call_parser=tool_call_parser,
                       enable_auto_tool_choice=enable_auto_tool_choice,
                       reasoning_parser=reasoning_parser,
                       loras=(LoRARegistry(engine.info.config.lora)
                              if engine.info.config.lora is not None else None))


# ---- command line ------------------------------------------------------------------------
def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from conveyor.config import EngineArgs

    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every route but /health "
                        f"(default: ${API_KEY_ENV} if set)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: --model)")
    g.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="abort a request not finished this long after it arrived")
    g.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   metavar="BYTES", help="answer 413 to a larger request body, before parsing "
                                         f"it (default {DEFAULT_MAX_BODY_BYTES})")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja2 chat template (file or text) overriding the checkpoint's")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto": the model decides, --tool-call-parser '
                        "finds its calls")
    g.add_argument("--tool-call-parser", default=None,
                   choices=("hermes", "llama3_json", "mistral"),
                   help="the checkpoint's tool-call format (Hermes/Qwen <tool_call>, Llama 3 "
                        "JSON, Mistral [TOOL_CALLS])")
    g.add_argument("--reasoning-parser", default=None, choices=("deepseek_r1", "qwen3"),
                   help="put the model's <think>...</think> in reasoning_content")
    g.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    g.add_argument("--no-access-log", action="store_true", help="do not log every request")
    g.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="N replicas of this server (each with these options, on loopback "
                        "ports of their own) behind conveyor router on --host/--port")
    g.add_argument("--routing", default="prefix",
                   help="with --data-parallel-size: the router's policy (prefix, "
                        "least-loaded, round-robin)")
    g.add_argument("--engine-core", default="process", choices=("process", "thread"),
                   help="where the engine loop runs: its own process (default; the model "
                        "never competes with HTTP for the GIL) or a thread of the server")
    EngineArgs.add_cli_args(parser)
    return parser


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    from conveyor.config import EngineArgs

    if args.data_parallel_size != 1:
        from conveyor.router.launcher import run_data_parallel

        return run_data_parallel(args)

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_args = EngineArgs.from_cli_args(args)
    # A server runs for days: per-request figures go to Prometheus as requests finish
    # (finish_listeners) instead of piling up in the engine's finished_metrics.
    engine = AsyncEngine.from_engine_args(engine_args, process=args.engine_core == "process",
                                          keep_metrics=False)
    state = make_state(engine, api_key=args.api_key or envs.api_key(),
                       request_timeout_s=args.request_timeout, chat_template=args.chat_template,
                       max_body_bytes=args.max_request_body_bytes,
                       tool_call_parser=args.tool_call_parser,
                       enable_auto_tool_choice=args.enable_auto_tool_choice,
                       reasoning_parser=args.reasoning_parser)
    cfg = engine.info.config
    logger.info("serving %r (%s, %s, %d KV blocks of %d tokens, max_model_len %d, engine "
                "loop in a %s) on http://%s:%d", state.model_name, cfg.model.dtype_label,
                cfg.device, cfg.cache.num_kv_blocks, cfg.cache.block_size, state.max_model_len,
                args.engine_core, args.host, args.port)
    config = uvicorn.Config(build_app(state), host=args.host, port=args.port,
                            log_level=args.log_level, access_log=not args.no_access_log,
                            timeout_graceful_shutdown=None)
    uvicorn.Server(config).run()
    return 0
