"""The engine core's loop: drain commands between steps, step while work remains.

The same loop runs in a thread of the server's process or alone in an engine-core
process (``core_process.py``); only its ``LoopTransport`` differs: how typed commands
arrive (``messages.CoreCommand``) and how core messages leave. It holds an
``EngineCore`` only: token ids in, token ids out; the front end (``AsyncEngine``) owns
text and streams.

Faults stay local: an add that raises is answered with that error alone; a step that
raises cannot be pinned on one request, so every request in the core fails (its blocks
freed, a ``RequestsFailed`` sent) and the loop goes on serving new ones. Only an error
while recovering stops the loop, and an ``ExecutorDeadError`` (a tensor-parallel rank
died): its requests fail the same way, then the loop ends with it, so the front end
reports the engine dead (``/health`` 503). An executor with ``check_health`` is asked
about every ``health_poll_s`` while idle, so a rank that dies between requests is found
too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from conveyor.engine.core import EngineCore
from conveyor.engine.messages import (
    AbortRequests,
    AddRequests,
    AddResult,
    CoreCommand,
    CoreMessage,
    ErrorInfo,
    RequestsFailed,
    Shutdown,
    StepOutputs,
    UtilityCall,
    UtilityMethod,
    UtilityResult,
)
from conveyor.executor.errors import ExecutorDeadError

logger = logging.getLogger(__name__)


@dataclass
class LocalCall:
    """Thread engines only (never crosses a process): run ``fn(core)`` between steps, for
    tests and in-process introspection. The result comes back as a ``UtilityResult``."""

    call_id: int
    fn: Callable[[EngineCore], Any]


LoopCommand = CoreCommand | LocalCall
LoopMessage = CoreMessage


class LoopTransport(Protocol):
    def take(self, wait: float | None) -> list[LoopCommand]:
        """Every queued command; blocks up to ``wait`` s (None: forever) for the first."""

    def post(self, messages: list[LoopMessage]) -> None:
        """Hand core messages to the front end (one batch per command batch or step)."""


class EngineLoop:
    def __init__(self, core: EngineCore, transport: LoopTransport,
                 idle_poll_s: float = 0.002, health_poll_s: float = 1.0) -> None:
        self.core = core
        self.transport = transport
        self.check_health: Callable[[], None] | None = getattr(core.executor,
                                                               "check_health", None)
        self.health_poll_s = health_poll_s
        self._last_health = time.monotonic()
        # While requests wait but none could be scheduled, re-check this often.
        self.idle_poll_s = idle_poll_s
        self.steps_left: int | None = None  # UtilityMethod.PAUSE: steps until paused

    @property
    def paused(self) -> bool:
        return self.steps_left == 0

    def run(self) -> BaseException | None:
        """Serve until a ``Shutdown``; returns the error that ended the loop, if any."""
        core = self.core
        idle = False
        try:
            while True:
                busy = core.has_unfinished_requests() and not self.paused
                wait = None if not busy else (self.idle_poll_s if idle else 0.0)
                if wait is None and self.check_health is not None:
                    wait = self.health_poll_s
                if self.handle(self.transport.take(wait)):
                    return None
                if not busy and self.check_health is not None \
                        and time.monotonic() - self._last_health >= self.health_poll_s:
                    self._check_executor()
                if core.has_unfinished_requests() and not self.paused:
                    idle = not self._step()
                    if self.steps_left is not None:
                        self.steps_left -= 1
                else:
                    idle = False
        except BaseException as e:  # a fault while recovering: the loop cannot go on
            logger.exception("the engine loop died")
            return e

    def handle(self, cmds: list[LoopCommand]) -> bool:
        """Apply commands in order; True when asked to stop."""
        posts: list[LoopMessage] = []
        for cmd in cmds:
            if isinstance(cmd, AddRequests):
                posts.append(self._add(cmd))
            elif isinstance(cmd, AbortRequests):
                # The front end already ended these requests; the core frees their blocks.
                self.core.abort_requests(cmd.request_ids, cmd.reason, cmd.stop_reason)
            elif isinstance(cmd, UtilityCall):
                posts.append(self._utility(cmd))
            elif isinstance(cmd, LocalCall):
                posts.append(self._call(cmd.call_id, cmd.fn))
            elif isinstance(cmd, Shutdown):
                if posts:
                    self.transport.post(posts)
                return True
        if posts:
            self.transport.post(posts)
        return False

    def _add(self, cmd: AddRequests) -> AddResult:
        first = cmd.requests[0].request_id if cmd.requests else ""
        try:
            self.core.add_requests(cmd.requests)
        except Exception as e:  # bad input (ValueError), QueueFullError, or a bug: this one only
            return AddResult(first, ErrorInfo.of(e))
        return AddResult(first)

    def _utility(self, cmd: UtilityCall) -> UtilityResult:
        if cmd.method is UtilityMethod.PAUSE:
            self.steps_left = max(cmd.args[0], 0) if cmd.args else 0
            return UtilityResult(cmd.call_id, True, True)
        if cmd.method is UtilityMethod.RESUME:
            self.steps_left = None
            return UtilityResult(cmd.call_id, True, True)
        return self._call(cmd.call_id, lambda c: c.utility(cmd.method, *cmd.args))

    def _call(self, call_id: int, fn: Callable[[EngineCore], Any]) -> UtilityResult:
        try:
            return UtilityResult(call_id, True, fn(self.core))
        except Exception as e:
            return UtilityResult(call_id, False, error=ErrorInfo.of(e))

    def _step(self) -> bool:
        """One engine step; False if it scheduled nothing (requests wait for room)."""
        try:
            outs = self.core.step()
        except ExecutorDeadError as e:
            self._recover_from_step_error(e)
            raise  # no step can run again: end the loop (the engine is dead)
        except Exception as e:
            self._recover_from_step_error(e)
            return True
        if outs.outputs:
            self.transport.post([StepOutputs(outs)])
        return outs.scheduled

    def _check_executor(self) -> None:
        self._last_health = time.monotonic()
        try:
            self.check_health()
        except ExecutorDeadError as e:
            self._recover_from_step_error(e)  # paused requests, if any
            raise

    def _recover_from_step_error(self, error: Exception) -> None:
        """A step raised: the requests in flight cannot be trusted, so they fail alone."""
        self.core.num_step_errors += 1
        ids = sorted(self.core.scheduler.requests)
        logger.exception("engine step failed; aborting the %d requests in flight", len(ids))
        self.core.abort_requests(ids)  # raising here ends the loop: the core is unusable
        self.transport.post([RequestsFailed(ids, ErrorInfo(
            "error", f"the engine step failed while this request was running: "
                     f"{type(error).__name__}: {error}"))])
