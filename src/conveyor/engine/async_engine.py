"""The engine loop off the event loop, with one async stream of outputs per request.

    event loop (server)                         engine loop (thread, or its own process)
    -------------------                         ---------------------------------------
    add_request() --- AddRequest ----------->   engine.add_request()   (validate, queue)
                  <-- accepted | error -------
    async for out in stream  <-- outputs ----   engine.step()  (loops while work remains)
    stream.close() / timeout --- Abort ----->   engine.abort_request() (blocks freed now)
    call(fn)      --- Call ----------------->   fn(engine)  (stats, pool counters)

``LLMEngine`` is not thread-safe, so every call into it happens on the engine loop
(``engine_loop.py``): the event loop only sends typed commands, and results come
back through ``loop.call_soon_threadsafe``. The loop drains commands between
steps, so adds and aborts wait at most one step.

Two homes for the loop: a thread of this process (``AsyncEngine(engine)``), or an
engine-core process of its own (``AsyncEngine.from_engine_args(args, process=True)``,
what ``conveyor serve`` does, as vLLM's and SGLang's servers do): there the model's
Python never competes for this process's GIL with HTTP parsing, JSON and streaming,
and a busy event loop cannot delay a step. Commands and outputs then cross pipes,
pickled in batches by a sender and a reader thread; ``call(fn)`` needs a picklable
``fn`` (a module-level function).

Faults stay local: a request whose add raises gets that error alone; a step that
raises fails the requests in flight and the loop goes on. If the loop stops (or
its process dies), ``is_alive`` turns false and every open stream fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from conveyor.config import EngineArgs, EngineConfig
from conveyor.engine.engine_loop import (
    Abort,
    Accepted,
    AddRequest,
    Call,
    Command,
    EngineLoop,
    EngineStepError,
    Stop,
    StreamItem,
)
from conveyor.engine.llm_engine import LLMEngine, PromptType, QueueFullError
from conveyor.outputs import RequestMetrics, RequestOutput
from conveyor.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "EngineInfo",
    "EngineStepError",
    "QueueFullError",
    "RequestStream",
    "RequestTimeoutError",
]


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down or crashed); no request can be served."""


class RequestTimeoutError(TimeoutError):
    """The request ran past its timeout and was aborted."""


@dataclass
class EngineInfo:
    """What the front end needs to know of the engine without reaching into it."""

    config: EngineConfig
    tokenizer: Any  # the engine's tokenizer (loaded again on this side for a process)

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len


class EngineSink(Protocol):
    """The front end's side of a backend; called from the backend's threads."""

    def items(self, items: list[tuple[str, StreamItem]]) -> None: ...
    def finished(self, metrics: list[RequestMetrics]) -> None: ...
    def call_done(self, call_id: int, ok: bool, value: Any) -> None: ...
    def died(self, error: BaseException | None) -> None: ...


def merge_delta_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One delta output covering both (``first`` is updated and returned)."""
    by_index = {c.index: c for c in first.outputs}
    for c in later.outputs:
        prev = by_index.get(c.index)
        if prev is None:
            by_index[c.index] = c
            continue
        prev.text += c.text
        prev.token_ids = prev.token_ids + c.token_ids
        if c.logprobs is not None:
            prev.logprobs = (prev.logprobs or []) + c.logprobs
        prev.cumulative_logprob = c.cumulative_logprob
        prev.finish_reason, prev.stop_reason = c.finish_reason, c.stop_reason
    first.outputs = sorted(by_index.values(), key=lambda c: c.index)
    first.finished = later.finished
    first.metrics = later.metrics
    first.num_cached_tokens = later.num_cached_tokens
    return first


class RequestStream:
    """Async iterator over one request's outputs; closing it early aborts the request.

    Ends after the output with ``finished=True``, or raises the request's error
    (``RequestTimeoutError``, ``EngineStepError``, ``EngineDeadError``). A consumer
    that falls behind gets the outputs waiting for it as one: deltas are merged,
    cumulative outputs replaced by the latest, so a slow client costs one chunk per
    read rather than one per engine step.
    """

    def __init__(self, engine: AsyncEngine, request_id: str, output_kind: str) -> None:
        self.request_id = request_id
        self.output_kind = output_kind
        self._engine = engine
        self._items: deque[StreamItem] = deque()
        self._ready = asyncio.Event()
        self._terminal_queued = False  # a finished output or an error is in the queue
        self._engine_done = False  # the engine holds nothing more for this request
        self._closed = False
        self._timer: asyncio.TimerHandle | None = None
        # From the first output: an engine-core process sends prompt, prompt ids and
        # metrics once, then outputs with prompt_token_ids=None (see core_process.py).
        self._first: RequestOutput | None = None

    # ---- producer side (event loop thread) -----------------------------------------------
    def _put(self, item: StreamItem) -> None:
        if self._terminal_queued or self._closed:
            return
        if isinstance(item, RequestOutput):
            if item.prompt_token_ids is None and self._first is not None:
                item.prompt = self._first.prompt
                item.prompt_token_ids = self._first.prompt_token_ids
                if item.metrics is None:
                    item.metrics = self._first.metrics
            elif self._first is None:
                self._first = item
        if isinstance(item, BaseException) or (
                isinstance(item, RequestOutput) and item.finished):
            self._terminal_queued = True
            if not isinstance(item, RequestTimeoutError):
                self._engine_done = True  # finished, failed to add, or aborted after a fault
        self._items.append(item)
        self._ready.set()

    def _on_timeout(self, timeout_s: float) -> None:
        self._put(RequestTimeoutError(
            f"request {self.request_id} did not finish within {timeout_s:g} s and was aborted"))
        self._engine.abort_nowait(self.request_id)

    # ---- consumer side -------------------------------------------------------------------
    async def _get(self) -> StreamItem:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()

    async def _wait_accepted(self) -> None:
        item = await self._get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        assert isinstance(item, Accepted), "the engine acknowledges a request first"

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed:
            raise StopAsyncIteration
        try:
            item = await self._get()
        except BaseException:
            self.close()  # cancelled (client gone): abort the request
            raise
        if isinstance(item, BaseException):
            self.close()
            raise item
        assert isinstance(item, RequestOutput)
        while not item.finished and self._items and isinstance(self._items[0], RequestOutput):
            later = self._items.popleft()
            item = merge_delta_outputs(item, later) if self.output_kind == "delta" else later
        if item.finished:
            self.close()
        return item

    @property
    def finished(self) -> bool:
        return self._engine_done

    def close(self) -> None:
        """Stop listening; aborts the request in the engine unless it already ended there."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        self._engine._unregister(self)
        if not self._engine_done:
            self._engine.abort_nowait(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Safety net for a stream dropped without close(): never leak the request's blocks.
        if not self._closed and not self._engine_done:
            self._engine.abort_nowait(self.request_id)


class AsyncEngine:
    """Serves asyncio callers from an engine loop in a thread or in its own process."""

    def __init__(self, engine: LLMEngine | None = None, *,
                 backend: ThreadBackend | Any = None) -> None:
        if (engine is None) == (backend is None):
            raise ValueError("pass an LLMEngine (thread) or a backend, not both")
        self._backend = backend if backend is not None else ThreadBackend(engine)
        # The in-process engine, or None when it lives in an engine-core process.
        self.engine: LLMEngine | None = engine
        self.info: EngineInfo = self._backend.info
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self._dead = False
        self._error: BaseException | None = None
        self._stopping = False
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()  # guards _calls and _dead across threads
        # Called (on an engine-side thread) with the metrics of requests that just
        # finished, after each step and after aborts: for Prometheus and the like.
        self.finish_listeners: list[Callable[[list[RequestMetrics]], None]] = []

    @classmethod
    def from_engine_args(cls, args: EngineArgs, *, process: bool = False,
                         keep_metrics: bool = True) -> AsyncEngine:
        """An engine from ``args``: in a thread of this process, or (``process``) in an
        engine-core process; ``keep_metrics=False`` for a long-running server."""
        if process:
            from conveyor.engine.core_process import ProcessBackend

            return cls(backend=ProcessBackend(args, keep_metrics=keep_metrics))
        engine = LLMEngine(args)
        engine.keep_metrics = keep_metrics
        return cls(engine)

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine loop; call from inside the event loop that will consume."""
        if self._started:
            raise RuntimeError("the engine loop is already started")
        self._started = True
        self._loop = asyncio.get_running_loop()
        self._backend.start(self)

    @property
    def is_alive(self) -> bool:
        return self._started and not self._dead and not self._stopping

    @property
    def error(self) -> BaseException | None:
        return self._error

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop after the current step; requests still in flight fail."""
        if not self._started:
            self._backend.close()
            return
        self._stopping = True
        self._backend.send(Stop())
        await asyncio.to_thread(self._backend.join, timeout_s)

    # ---- requests ------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                          priority: int = 0, tenant: str | None = None,
                          slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
                          output_kind: str = "delta",
                          timeout_s: float | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it.

        Raises what ``LLMEngine.add_request`` raises (ValueError, QueueFullError),
        RequestTimeoutError, or EngineDeadError. ``timeout_s`` bounds the whole
        request from now: past it the stream raises RequestTimeoutError and the
        request is aborted.
        """
        self._check_alive()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(self, request_id, output_kind)
        self._streams[request_id] = stream
        if timeout_s is not None:
            assert self._loop is not None
            stream._timer = self._loop.call_later(timeout_s, stream._on_timeout, timeout_s)
        self._backend.send(AddRequest(request_id, prompt, params, output_kind, priority,
                                      tenant, slo_ttft_ms, slo_tpot_ms))
        try:
            await stream._wait_accepted()
        except BaseException:
            stream.close()
            raise
        return stream

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       **kwargs: Any) -> AsyncIterator[RequestOutput]:
        """``add_request`` then iterate; leaving the loop early aborts the request."""
        stream = await self.add_request(request_id, prompt, params, **kwargs)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.close()
        else:
            self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        """Thread-safe; the engine frees the request's blocks before its next step."""
        if not self._dead:
            self._backend.send(Abort([request_id]))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine loop between steps; returns its result.

        With an engine-core process ``fn`` must be picklable (a module-level function)."""
        self._check_alive()
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._dead:
                raise EngineDeadError(f"the engine loop is not running: {self._error!r}")
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        self._backend.send(Call(call_id, fn))
        return await asyncio.wrap_future(future)

    async def stats(self) -> dict[str, Any]:
        return await self.call(_stats_snapshot)

    def _check_alive(self) -> None:
        if not self.is_alive:
            reason = f": {self._error!r}" if self._error is not None else ""
            raise EngineDeadError(f"the engine loop is not running{reason}")

    def _unregister(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    # ---- EngineSink: called from the backend's threads -----------------------------------
    def items(self, items: list[tuple[str, StreamItem]]) -> None:
        """Hand items to their streams on the event loop (one wake-up for the batch)."""
        if self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self._loop.call_soon_threadsafe(self._deliver, items)

    def finished(self, metrics: list[RequestMetrics]) -> None:
        for listener in self.finish_listeners:
            try:
                listener(metrics)
            except Exception:  # metrics must never fail a request
                logger.exception("finish listener %r failed", listener)

    def call_done(self, call_id: int, ok: bool, value: Any) -> None:
        with self._lock:
            future = self._calls.pop(call_id, None)
        if future is None or not future.set_running_or_notify_cancel():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def died(self, error: BaseException | None) -> None:
        """The loop ended (shut down, crashed, or its process died)."""
        with self._lock:
            self._dead = True
            self._error = self._error or error
            calls, self._calls = self._calls, {}
        reason = self._error or "the engine was shut down"
        dead = EngineDeadError(f"the engine loop stopped: {reason}")
        for future in calls.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(dead)
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._fail_all_streams, dead)

    # ---- event loop side -----------------------------------------------------------------
    def _deliver(self, items: list[tuple[str, StreamItem]]) -> None:
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is None:
                continue  # closed by its consumer; the abort is already queued
            try:
                stream._put(item)
            except Exception:
                logger.exception("delivering to request %s failed", request_id)

    def _fail_all_streams(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream._engine_done = True  # the engine is gone: nothing left to abort
            stream._put(error)


def _stats_snapshot(engine: LLMEngine) -> dict[str, Any]:
    stats = engine.stats()
    stats["num_free_kv_blocks"] = engine.kv.num_free_blocks
    return stats


# ---- the engine loop in a thread of this process ---------------------------------------------
class _QueueTransport:
    """Engine-thread side: commands from a queue, results straight to the sink."""

    def __init__(self, commands: queue.SimpleQueue[Command], sink: EngineSink) -> None:
        self.commands = commands
        self.sink = sink

    def take(self, wait: float | None) -> list[Command]:
        cmds: list[Command] = []
        try:
            if wait is None:
                cmds.append(self.commands.get())
            elif wait > 0:
                cmds.append(self.commands.get(timeout=wait))
        except queue.Empty:
            return cmds
        while True:
            try:
                cmds.append(self.commands.get_nowait())
            except queue.Empty:
                return cmds

    def post(self, items: list[tuple[str, StreamItem]]) -> None:
        self.sink.items(items)

    def finished(self, metrics: list[RequestMetrics]) -> None:
        self.sink.finished(metrics)

    def call_done(self, call_id: int, ok: bool, value: Any) -> None:
        self.sink.call_done(call_id, ok, value)

    def released(self, request_ids: list[str]) -> None:
        pass


class ThreadBackend:
    """Runs the engine loop in a daemon thread of this process."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.info = EngineInfo(engine.config, engine.tokenizer)
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, sink: EngineSink) -> None:
        loop = EngineLoop(self.engine, _QueueTransport(self._commands, sink))

        def run() -> None:
            error = None
            try:
                error = loop.run()
            finally:
                sink.died(error)

        self._thread = threading.Thread(target=run, name="conveyor-engine", daemon=True)
        self._thread.start()

    def send(self, cmd: Command) -> None:
        self._commands.put(cmd)

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def close(self) -> None:
        pass
