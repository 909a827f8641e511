"""The serving front end: one async stream per request around an engine core that runs
in a thread or in an engine-core process of its own.

    event loop (front end: text, streams)          engine core loop (thread or process)
    -------------------------------------          ------------------------------------
    add_request(): tokenize, validate, fan out
        --- AddRequests([EngineCoreRequest]) -->   core.add_requests()  (all or none)
        <-- AddResult(id, error | None) --------
    output processor (text, stop strings)  <----   StepOutputs(EngineCoreOutputs) per step
        --- AbortRequests(ids, "stop") -------->   (a stop string the front end found)
    stream.close() / timeout
        --- AbortRequests(ids, "abort") ------->   core.abort_requests()  (blocks freed)
    utility(UtilityMethod) --- UtilityCall --->    core.utility()

Only typed messages (``messages.py``) and token ids cross; the front end loads the
tokenizer, the core never sees text. In a process (``AsyncEngine.from_engine_args(args,
process=True)``, what ``conveyor serve`` does) the model's Python never competes with
HTTP for a GIL and this process imports no torch. Per-request state lives in the
front end's ``OutputProcessor`` (text, metrics) and the core's scheduler (tokens, blocks).

Faults stay local: a request whose add fails gets that error alone; a step that raises
fails the requests in flight and the loop goes on. If the loop stops (or its process
dies), ``is_alive`` turns false and every open stream fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from conveyor.config import EngineArgs
from conveyor.config.lora import LoRARequest
from conveyor.engine.backend import CoreBackend, EngineInfo, EngineSink
from conveyor.engine.core import EngineCore
from conveyor.engine.engine_loop import EngineLoop, LocalCall, LoopCommand, LoopMessage
from conveyor.engine.llm_engine import (
    LLMEngine,
    PromptType,
    tokenize_prompt,
    validate_request,
)
from conveyor.engine.messages import (
    AbortRequests,
    AddRequests,
    AddResult,
    QueueFullError,
    RequestsFailed,
    Shutdown,
    StepOutputs,
    UtilityCall,
    UtilityMethod,
    UtilityResult,
)
from conveyor.engine.output_processor import OutputProcessor, fan_out
from conveyor.engine.validation import validate_lora, validate_scheduling
from conveyor.kv_transfer.messages import KVTransferParams
from conveyor.outputs import RequestMetrics, RequestOutput
from conveyor.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

__all__ = [
    "AsyncEngine",
    "EngineDeadError",
    "EngineStepError",
    "QueueFullError",
    "RequestStream",
    "RequestTimeoutError",
]


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down or crashed); no request can be served."""


class EngineStepError(RuntimeError):
    """An engine step raised while this request was in flight; the request was aborted."""


class RequestTimeoutError(TimeoutError):
    """The request ran past its timeout and was aborted."""


class Accepted:
    """Stream item: the engine validated and queued the request."""


StreamItem = RequestOutput | BaseException | Accepted


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
    if first.prompt_logprobs is None:
        first.prompt_logprobs = later.prompt_logprobs
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

    # ---- producer side (event loop thread) -----------------------------------------------
    def _put(self, item: StreamItem) -> None:
        if self._terminal_queued or self._closed:
            return
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
        if not self._closed and not self._engine_done:
            with contextlib.suppress(Exception):
                self.close()


class AsyncEngine:
    """Serves asyncio callers from an engine core in a thread or in its own process."""

    def __init__(self, engine: LLMEngine | EngineCore | None = None, *,
                 backend: CoreBackend | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if (engine is None) == (backend is None):
            raise ValueError("pass an engine (thread) or a backend, not both")
        if backend is None:
            core = engine.core if isinstance(engine, LLMEngine) else engine
            tokenizer = engine.tokenizer if isinstance(engine, LLMEngine) else None
            backend = ThreadBackend(core, tokenizer)
        self._backend = backend
        # The in-process core, or None when it lives in an engine-core process.
        self.core: EngineCore | None = getattr(backend, "core", None)
        self.info: EngineInfo = backend.info
        self.clock = clock  # the core's clock: monotonic time is one clock for all processes
        self._processor = OutputProcessor(self.info.tokenizer, self.info.config.scheduler.policy)
        self._streams: dict[str, RequestStream] = {}
        self._adding: dict[str, RequestStream] = {}  # first core request id -> stream
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self._dead = False
        self._error: BaseException | None = None
        self._stopping = False
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()  # guards _calls and _dead across threads
        # Called on the event loop with the metrics of requests that just finished (after
        # a step or an abort): for Prometheus and the like.
        self.finish_listeners: list[Callable[[list[RequestMetrics]], None]] = []
        self.keep_metrics = True
        self.finished_metrics: list[RequestMetrics] = []

    @classmethod
    def from_engine_args(cls, args: EngineArgs, *, process: bool = False,
                         keep_metrics: bool = True) -> AsyncEngine:
        """An engine from ``args``: in a thread of this process, or (``process``) in an
        engine-core process; ``keep_metrics=False`` for a long-running server."""
        if process:
            from conveyor.engine.core_process import ProcessBackend

            engine = cls(backend=ProcessBackend(args))
        else:
            engine = cls(LLMEngine(args))
        engine.keep_metrics = keep_metrics
        return engine

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
        self._backend.send(Shutdown())
        await asyncio.to_thread(self._backend.join, timeout_s)

    # ---- requests ------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                          priority: int = 0, tenant: str | None = None,
                          slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
                          output_kind: str = "delta",
                          timeout_s: float | None = None,
                          kv_transfer_params: KVTransferParams | None = None,
                          lora_request: LoRARequest | None = None
                          ) -> RequestStream:
        """Tokenize, validate and queue a request; returns its stream once the core took it.

        Raises ValueError (bad input), QueueFullError, RequestTimeoutError, or
        EngineDeadError. ``timeout_s`` bounds the whole request from now: past it the
        stream raises RequestTimeoutError and the request is aborted.
        """
        self._check_alive()
        if request_id in self._streams:  # (one still being read; the processor checks its own)
            raise ValueError(f"request id {request_id!r} is already in use")
        text, prompt_ids = tokenize_prompt(self.info.tokenizer, prompt)
        validate_request(self.info.config, self.info.tokenizer is not None, prompt_ids, params)
        validate_scheduling(priority, tenant, slo_ttft_ms, slo_tpot_ms)
        validate_lora(self.info.config, lora_request)
        children = fan_out(request_id, prompt_ids, params, self.clock(), priority=priority,
                           tenant=tenant, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
                           kv_transfer_params=kv_transfer_params, lora_request=lora_request)
        self._processor.add(request_id, text, params, children, output_kind)
        stream = RequestStream(self, request_id, output_kind)
        self._streams[request_id] = stream
        self._adding[children[0].request_id] = stream
        if timeout_s is not None:
            assert self._loop is not None
            stream._timer = self._loop.call_later(timeout_s, stream._on_timeout, timeout_s)
        self._backend.send(AddRequests(children))
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
        """Call on the event loop: the request ends now; the core frees its blocks before
        its next step."""
        children = self._processor.child_ids(request_id)
        if children and not self._dead:
            self._backend.send(AbortRequests(children))
        aborted = self._processor.abort(request_id, self.clock())
        if aborted is not None:
            self._finished(aborted[1])

    async def utility(self, method: UtilityMethod, *args: int) -> Any:
        """A typed call into the core between two steps (stats, free blocks, pause...)."""
        return await self._call(lambda call_id: UtilityCall(call_id, method, list(args)))

    async def call(self, fn: Callable[[EngineCore], Any]) -> Any:
        """Thread engines only: run ``fn(core)`` on the engine loop between steps (tests,
        in-process introspection). Nothing callable crosses to an engine-core process:
        use ``utility`` there."""
        if not self._backend.accepts_local_calls:
            raise TypeError("the engine core runs in another process: only typed utility "
                            "calls cross (AsyncEngine.utility)")
        return await self._call(lambda call_id: LocalCall(call_id, fn))

    async def _call(self, make: Callable[[int], LoopCommand]) -> Any:
        self._check_alive()
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._dead:
                raise EngineDeadError(f"the engine loop is not running: {self._error!r}")
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        self._backend.send(make(call_id))
        return await asyncio.wrap_future(future)

    async def stats(self) -> dict[str, Any]:
        return await self.utility(UtilityMethod.STATS)

    def _check_alive(self) -> None:
        if not self.is_alive:
            reason = f": {self._error!r}" if self._error is not None else ""
            raise EngineDeadError(f"the engine loop is not running{reason}")

    def _unregister(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    # ---- EngineSink: called from the backend's threads -----------------------------------
    def messages(self, messages: list[LoopMessage]) -> None:
        """Hand core messages to the event loop, in order (one wake-up for the batch)."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody listens any more
                self._loop.call_soon_threadsafe(self._handle, messages)

    def _call_done(self, m: UtilityResult) -> None:
        with self._lock:
            future = self._calls.pop(m.call_id, None)
        if future is None or not future.set_running_or_notify_cancel():
            return
        if m.ok:
            future.set_result(m.value)
        else:
            future.set_exception(m.error.rebuild() if m.error else RuntimeError("failed"))

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
    def _handle(self, messages: list[LoopMessage]) -> None:
        for m in messages:
            try:
                if isinstance(m, StepOutputs):
                    self._on_outputs(m)
                elif isinstance(m, AddResult):
                    self._on_added(m)
                elif isinstance(m, UtilityResult):
                    self._call_done(m)
                elif isinstance(m, RequestsFailed):
                    self._on_failed(m)
            except Exception:
                logger.exception("handling %s from the engine core failed", type(m).__name__)

    def _on_added(self, m: AddResult) -> None:
        stream = self._adding.pop(m.request_id, None)
        if stream is None:
            return  # closed before the core answered; its abort is queued
        if m.error is None:
            stream._put(Accepted())
            return
        self._processor.fail(stream.request_id)
        stream._engine_done = True
        stream._put(m.error.rebuild())

    def _on_outputs(self, m: StepOutputs) -> None:
        outputs, stopped, finished = self._processor.process(m.outputs)
        for child_id, stop in stopped:  # the core frees the sample's blocks
            self._backend.send(AbortRequests([child_id], "stop", stop))
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream._put(out)
        self._finished(finished)

    def _on_failed(self, m: RequestsFailed) -> None:
        parents = dict.fromkeys(p for p in map(self._processor.parent_of, m.request_ids) if p)
        error = EngineStepError(m.error.message)
        for rid in parents:
            self._processor.fail(rid)
            stream = self._streams.get(rid)
            if stream is not None:
                stream._engine_done = True
                stream._put(error)

    def _finished(self, metrics: list[RequestMetrics]) -> None:
        if not metrics:
            return
        if self.keep_metrics:
            self.finished_metrics.extend(metrics)
        for listener in self.finish_listeners:
            try:
                listener(metrics)
            except Exception:  # metrics must never fail a request
                logger.exception("finish listener %r failed", listener)

    def _fail_all_streams(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream._engine_done = True  # the engine is gone: nothing left to abort
            self._processor.fail(stream.request_id)
            stream._put(error)


# ---- the engine core in a thread of this process ---------------------------------------------
class _QueueTransport:
    """Engine-thread side: commands from a queue, messages straight to the sink."""

    def __init__(self, commands: queue.SimpleQueue[LoopCommand], sink: EngineSink) -> None:
        self.commands = commands
        self.sink = sink

    def take(self, wait: float | None) -> list[LoopCommand]:
        cmds: list[LoopCommand] = []
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

    def post(self, messages: list[LoopMessage]) -> None:
        self.sink.messages(messages)


class ThreadBackend:
    """Runs the engine core's loop in a daemon thread of this process."""

    accepts_local_calls = True

    def __init__(self, core: EngineCore, tokenizer: Any) -> None:
        self.core = core
        self.info = EngineInfo(core.config, tokenizer)
        self._commands: queue.SimpleQueue[LoopCommand] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, sink: EngineSink) -> None:
        loop = EngineLoop(self.core, _QueueTransport(self._commands, sink))

        def run() -> None:
            error = None
            try:
                error = loop.run()
            finally:
                try:
                    self.core.executor.shutdown()  # tensor-parallel ranks stop with it
                finally:
                    sink.died(error)

        self._thread = threading.Thread(target=run, name="conveyor-engine", daemon=True)
        self._thread.start()

    def send(self, cmd: LoopCommand) -> None:
        self._commands.put(cmd)

    def join(self, timeout_s: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout_s)

    def close(self) -> None:
        pass
