"""The engine side of ``AsyncEngine``: drain commands between steps, step while work remains.

The same loop runs in a thread of the server's process or alone in an engine-core
process (``core_process.py``); only its ``LoopTransport`` differs: how commands
arrive and how outputs, finished requests' metrics and call results leave.

Faults stay local: a request whose add raises gets that error alone; a step that
raises cannot be pinned on one request, so the requests in flight fail (their
blocks freed) and the loop goes on serving new ones. Only an error while
recovering stops the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from conveyor.engine.llm_engine import LLMEngine, PromptType
from conveyor.outputs import RequestMetrics, RequestOutput
from conveyor.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """An engine step raised while this request was in flight; the request was aborted."""


# ---- commands: front end -> engine loop (picklable: they cross processes) ----------------
@dataclass
class AddRequest:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    output_kind: str
    priority: int = 0
    tenant: str | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None


@dataclass
class Abort:
    request_ids: list[str]


@dataclass
class Call:
    """Run ``fn(engine)`` between steps; the result goes back under ``call_id``."""

    call_id: int
    fn: Callable[[LLMEngine], Any]


@dataclass
class Stop:
    pass


Command = AddRequest | Abort | Call | Stop


class Accepted:
    """Stream item: the engine validated and queued the request."""


StreamItem = RequestOutput | BaseException | Accepted


class LoopTransport(Protocol):
    def take(self, wait: float | None) -> list[Command]:
        """Every queued command; blocks up to ``wait`` s (None: forever) for the first."""

    def post(self, items: list[tuple[str, StreamItem]]) -> None:
        """Hand stream items (outputs, acceptances, errors) to their requests."""

    def finished(self, metrics: list[RequestMetrics]) -> None:
        """Requests just finished (after a step or an abort), for Prometheus and the like."""

    def call_done(self, call_id: int, ok: bool, value: Any) -> None:
        """A ``Call``'s result (``ok``) or exception."""

    def released(self, request_ids: list[str]) -> None:
        """These requests left the engine without a finished output (aborted)."""


class EngineLoop:
    def __init__(self, engine: LLMEngine, transport: LoopTransport,
                 idle_poll_s: float = 0.002) -> None:
        self.engine = engine
        self.transport = transport
        # While requests wait but none could be scheduled, re-check this often.
        self.idle_poll_s = idle_poll_s
        self.inflight: set[str] = set()  # requests the engine holds that a stream waits on
        engine.step_listeners.append(lambda _engine, done: self._notify_finished(done))

    def run(self) -> BaseException | None:
        """Serve until a ``Stop``; returns the error that ended the loop, if any."""
        engine = self.engine
        idle = False
        try:
            while True:
                busy = engine.has_unfinished_requests()
                wait = None if not busy else (self.idle_poll_s if idle else 0.0)
                if self.handle(self.transport.take(wait)):
                    return None
                if engine.has_unfinished_requests():
                    idle = not self._step()
                else:
                    idle = False
        except BaseException as e:  # a fault while recovering: the loop cannot go on
            logger.exception("the engine loop died")
            return e

    def handle(self, cmds: list[Command]) -> bool:
        """Apply commands in order; True when asked to stop."""
        posts: list[tuple[str, StreamItem]] = []
        aborts: list[str] = []
        stop = False
        for cmd in cmds:
            if isinstance(cmd, AddRequest):
                if aborts:  # keep order: an abort queued before this add applies first
                    self._abort(aborts)
                    aborts = []
                posts.append((cmd.request_id, self._add(cmd)))
            elif isinstance(cmd, Abort):
                aborts.extend(cmd.request_ids)
            elif isinstance(cmd, Call):
                if aborts:
                    self._abort(aborts)
                    aborts = []
                self._run_call(cmd)
            else:
                stop = True
        if aborts:
            self._abort(aborts)
        if posts:
            self.transport.post(posts)
        return stop

    def _add(self, cmd: AddRequest) -> StreamItem:
        try:
            self.engine.add_request(
                cmd.prompt, cmd.params, request_id=cmd.request_id, priority=cmd.priority,
                tenant=cmd.tenant, slo_ttft_ms=cmd.slo_ttft_ms, slo_tpot_ms=cmd.slo_tpot_ms,
                output_kind=cmd.output_kind)
        except Exception as e:  # bad input (ValueError), QueueFullError, or a bug: this one only
            return e
        self.inflight.add(cmd.request_id)
        return Accepted()

    def _abort(self, request_ids: list[str]) -> None:
        ids = [rid for rid in dict.fromkeys(request_ids) if rid in self.inflight]
        if not ids:
            return
        self.inflight.difference_update(ids)
        self.transport.released(ids)
        outputs = self.engine.abort_request(ids)
        self._notify_finished([o.metrics for o in outputs if o.metrics is not None])

    def _run_call(self, cmd: Call) -> None:
        try:
            value = cmd.fn(self.engine)
        except Exception as e:
            self.transport.call_done(cmd.call_id, False, e)
        else:
            self.transport.call_done(cmd.call_id, True, value)

    def _step(self) -> bool:
        """One engine step; False if it scheduled nothing (requests wait for room)."""
        steps_before = self.engine.scheduler.stats.num_steps
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._recover_from_step_error(e)
            return True
        posts: list[tuple[str, StreamItem]] = []
        for out in outputs:
            if out.finished:
                self.inflight.discard(out.request_id)
            posts.append((out.request_id, out))
        if posts:
            self.transport.post(posts)
        return self.engine.scheduler.stats.num_steps != steps_before

    def _recover_from_step_error(self, error: Exception) -> None:
        """A step raised: the requests in flight cannot be trusted, so they fail alone."""
        self.engine.num_step_errors += 1
        logger.exception("engine step failed; aborting the %d requests in flight",
                         len(self.inflight))
        ids = sorted(self.inflight)
        self._abort(ids)  # raising here ends the loop: the engine is unusable
        failure = EngineStepError(f"the engine step failed while this request was running: "
                                  f"{type(error).__name__}: {error}")
        self.transport.post([(rid, failure) for rid in ids])

    def _notify_finished(self, finished: list[RequestMetrics]) -> None:
        if finished:
            self.transport.finished(finished)
