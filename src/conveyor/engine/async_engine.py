"""The engine loop in its own thread, with one async stream of outputs per request.

    event loop (server)                         engine thread
    -------------------                         -------------
    add_request() --- _AddRequest ---------->   engine.add_request()   (validate, queue)
                  <-- accepted | error -------
    async for out in stream  <-- outputs ----   engine.step()  (loops while work remains)
    stream.close() / timeout --- _Abort ---->   engine.abort_request() (blocks freed now)
    call(fn)      --- _Call ---------------->   fn(engine)  (stats, pool counters)

``LLMEngine`` is not thread-safe, so every call into it happens on the engine
thread: the event loop only enqueues typed commands, and the engine thread only
hands results back through ``loop.call_soon_threadsafe``. The engine thread
drains commands between steps, so adds and aborts wait at most one step.

Faults stay local: a request whose add raises gets that error alone; a step that
raises cannot be pinned on one request, so the requests in flight fail (their
blocks freed) and the loop goes on serving new ones. Only an error while
recovering stops the loop, and then ``is_alive`` turns false.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from conveyor.config import EngineArgs
from conveyor.engine.llm_engine import LLMEngine, PromptType, QueueFullError
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

# While requests wait but none could be scheduled, re-check this often (seconds).
_IDLE_POLL_S = 0.002


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down or crashed); no request can be served."""


class EngineStepError(RuntimeError):
    """An engine step raised while this request was in flight; the request was aborted."""


class RequestTimeoutError(TimeoutError):
    """The request ran past its timeout and was aborted."""


# ---- commands: event loop -> engine thread ------------------------------------------------
@dataclass
class _AddRequest:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    output_kind: str
    priority: int = 0
    tenant: str | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Stop:
    pass


_Command = _AddRequest | _Abort | _Call | _Stop


class _Accepted:
    """Stream item: the engine validated and queued the request."""


_ACCEPTED = _Accepted()
_StreamItem = RequestOutput | BaseException | _Accepted


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
        self._items: deque[_StreamItem] = deque()
        self._ready = asyncio.Event()
        self._terminal_queued = False  # a finished output or an error is in the queue
        self._engine_done = False  # the engine holds nothing more for this request
        self._closed = False
        self._timer: asyncio.TimerHandle | None = None

    # ---- producer side (event loop thread) -----------------------------------------------
    def _put(self, item: _StreamItem) -> None:
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
    async def _get(self) -> _StreamItem:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()

    async def _wait_accepted(self) -> None:
        item = await self._get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        assert item is _ACCEPTED, "the engine acknowledges a request before any output"

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
    """Runs an ``LLMEngine`` in a background thread, serving asyncio callers."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stopping = False
        # Engine-thread state: requests the engine holds that a stream waits on.
        self._inflight: set[str] = set()
        self.num_step_errors = 0
        # Called on the engine thread with the metrics of requests that just finished
        # (after each step, and after aborts) for Prometheus and the like.
        self.finish_listeners: list[Callable[[list[RequestMetrics]], None]] = []
        engine.step_listeners.append(self._on_step_finished)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncEngine:
        return cls(LLMEngine(args))

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from inside the event loop that will consume."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="conveyor-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive()
                and self._error is None and not self._stopping)

    @property
    def error(self) -> BaseException | None:
        return self._error

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the loop after the current step; requests still in flight fail."""
        if self._thread is None:
            return
        self._stopping = True
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join, timeout_s)

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
        self._commands.put(_AddRequest(request_id, prompt, params, output_kind, priority,
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
        self._commands.put(_Abort([request_id]))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps; returns its result."""
        self._check_alive()
        cmd = _Call(fn)
        self._commands.put(cmd)
        assert self._thread is not None
        if not self._thread.is_alive():  # it died after the check: nobody else will answer
            self._fail_pending_calls(EngineDeadError("the engine loop is not running"))
        return await asyncio.wrap_future(cmd.future)

    async def stats(self) -> dict[str, Any]:
        def snapshot(engine: LLMEngine) -> dict[str, Any]:
            stats = engine.stats()
            stats["num_free_kv_blocks"] = engine.kv.num_free_blocks
            stats["num_step_errors"] = self.num_step_errors
            return stats

        return await self.call(snapshot)

    def _check_alive(self) -> None:
        if not self.is_alive:
            reason = f": {self._error!r}" if self._error is not None else ""
            raise EngineDeadError(f"the engine loop is not running{reason}")

    def _unregister(self, stream: RequestStream) -> None:
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]

    # ---- event loop side of the hand-off -------------------------------------------------
    def _post(self, items: list[tuple[str, _StreamItem]]) -> None:
        """Engine thread: hand items to their streams on the event loop (one wake-up)."""
        if not items or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
            self._loop.call_soon_threadsafe(self._deliver, items)

    def _deliver(self, items: list[tuple[str, _StreamItem]]) -> None:
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

    # ---- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        idle = False
        try:
            while True:
                busy = engine.has_unfinished_requests()
                wait = None if not busy else (_IDLE_POLL_S if idle else 0.0)
                if self._handle_commands(self._take_commands(wait)):
                    break
                if engine.has_unfinished_requests():
                    idle = not self._step()
                else:
                    idle = False
        except BaseException as e:  # a fault while recovering: the loop cannot go on
            self._error = e
            logger.exception("the engine loop died")
        finally:
            reason = self._error or "the engine was shut down"
            dead = EngineDeadError(f"the engine loop stopped: {reason}")
            self._fail_pending_calls(dead)
            if self._loop is not None:
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(self._fail_all_streams, dead)

    def _take_commands(self, wait: float | None) -> list[_Command]:
        """All queued commands; blocks up to ``wait`` seconds (None: forever) for the first."""
        cmds: list[_Command] = []
        try:
            if wait is None:
                cmds.append(self._commands.get())
            elif wait > 0:
                cmds.append(self._commands.get(timeout=wait))
        except queue.Empty:
            return cmds
        while True:
            try:
                cmds.append(self._commands.get_nowait())
            except queue.Empty:
                return cmds

    def _handle_commands(self, cmds: list[_Command]) -> bool:
        """Apply commands in order; True when asked to stop."""
        posts: list[tuple[str, _StreamItem]] = []
        aborts: list[str] = []
        stop = False
        for cmd in cmds:
            if isinstance(cmd, _AddRequest):
                if aborts:  # keep order: an abort queued before this add applies first
                    self._abort(aborts)
                    aborts = []
                posts.append((cmd.request_id, self._add(cmd)))
            elif isinstance(cmd, _Abort):
                aborts.extend(cmd.request_ids)
            elif isinstance(cmd, _Call):
                if aborts:
                    self._abort(aborts)
                    aborts = []
                self._run_call(cmd)
            else:
                stop = True
        if aborts:
            self._abort(aborts)
        self._post(posts)
        return stop

    def _add(self, cmd: _AddRequest) -> _StreamItem:
        try:
            self.engine.add_request(
                cmd.prompt, cmd.params, request_id=cmd.request_id, priority=cmd.priority,
                tenant=cmd.tenant, slo_ttft_ms=cmd.slo_ttft_ms, slo_tpot_ms=cmd.slo_tpot_ms,
                output_kind=cmd.output_kind)
        except Exception as e:  # bad input (ValueError), QueueFullError, or a bug: this one only
            return e
        self._inflight.add(cmd.request_id)
        return _ACCEPTED

    def _abort(self, request_ids: list[str]) -> None:
        ids = [rid for rid in dict.fromkeys(request_ids) if rid in self._inflight]
        if not ids:
            return
        self._inflight.difference_update(ids)
        outputs = self.engine.abort_request(ids)
        self._notify_finished([o.metrics for o in outputs if o.metrics is not None])

    def _run_call(self, cmd: _Call) -> None:
        if not cmd.future.set_running_or_notify_cancel():
            return
        try:
            cmd.future.set_result(cmd.fn(self.engine))
        except Exception as e:
            cmd.future.set_exception(e)

    def _fail_pending_calls(self, error: BaseException) -> None:
        for cmd in self._take_commands(0.0):
            if isinstance(cmd, _Call) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(error)

    def _step(self) -> bool:
        """One engine step; False if it scheduled nothing (requests wait for room)."""
        steps_before = self.engine.scheduler.stats.num_steps
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._recover_from_step_error(e)
            return True
        posts: list[tuple[str, _StreamItem]] = []
        for out in outputs:
            if out.finished:
                self._inflight.discard(out.request_id)
            posts.append((out.request_id, out))
        self._post(posts)
        return self.engine.scheduler.stats.num_steps != steps_before

    def _recover_from_step_error(self, error: Exception) -> None:
        """A step raised: the requests in flight cannot be trusted, so they fail alone."""
        self.num_step_errors += 1
        logger.exception("engine step failed; aborting the %d requests in flight",
                         len(self._inflight))
        ids = sorted(self._inflight)
        self._abort(ids)  # raising here ends the loop (``_run``): the engine is unusable
        failure = EngineStepError(f"the engine step failed while this request was running: "
                                  f"{type(error).__name__}: {error}")
        self._post([(rid, failure) for rid in ids])

    def _on_step_finished(self, engine: LLMEngine, finished: list[RequestMetrics]) -> None:
        self._notify_finished(finished)

    def _notify_finished(self, finished: list[RequestMetrics]) -> None:
        if not finished:
            return
        for listener in self.finish_listeners:
            try:
                listener(finished)
            except Exception:  # metrics must never fail a request
                logger.exception("finish listener %r failed", listener)
