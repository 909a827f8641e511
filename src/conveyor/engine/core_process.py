"""The engine loop in an engine-core process of its own, behind two pipes.

    server process                                   engine-core process (spawned)
    --------------                                   -----------------------------
    AsyncEngine.send(cmd) -> queue -> sender thread == commands ==>  EngineLoop.take()
    AsyncEngine (sink)  <- reader thread <== items, metrics, call results ==  EngineLoop

The child builds the ``LLMEngine`` (model, KV pool, tokenizer), reports its final
config, then runs the same ``EngineLoop`` a thread would. The server process never
runs model code: its GIL serves HTTP, and the child's serves the model. Commands are
queued without blocking the event loop (a full pipe blocks the sender thread only)
and sent in batches; outputs go back once per step as one pickled list.

The child ignores SIGINT (the server decides when to stop and sends ``Stop``) and
exits when its command pipe closes, so it never outlives the server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
from multiprocessing.connection import Connection
from typing import Any

from conveyor.config import EngineArgs
from conveyor.engine.async_engine import EngineInfo, EngineSink
from conveyor.engine.engine_loop import (
    AddRequest,
    Call,
    Command,
    EngineLoop,
    Stop,
    StreamItem,
)
from conveyor.outputs import RequestMetrics, RequestOutput

logger = logging.getLogger(__name__)

# Messages from the child: ("ready", EngineConfig) | ("fatal", str) once at start, then
# ("items", [(request_id, item)]) | ("finished", [RequestMetrics]) |
# ("call", call_id, ok, value) | ("exit", error or None).


class EngineCoreStartError(RuntimeError):
    """The engine-core process could not build its engine (bad model, out of memory...)."""


def _portable(value: Any) -> Any:
    """``value``, or for an exception that does not pickle, a RuntimeError saying what it was."""
    if isinstance(value, BaseException):
        try:
            pickle.dumps(value)
        except Exception:
            return RuntimeError(f"{type(value).__name__}: {value}")
    return value


class _PipeTransport:
    """Engine side, in the child: commands from one pipe, results into the other."""

    def __init__(self, commands: Connection, results: Connection) -> None:
        self.commands = commands
        self.results = results
        # Requests whose prompt the front end already has (its stream keeps it): later
        # outputs leave out prompt, prompt ids and metrics, so a step's message grows
        # with the new tokens only, not with every running request's prompt.
        self._prompt_sent: set[str] = set()

    def take(self, wait: float | None) -> list[Command]:
        try:
            if wait is not None and not self.commands.poll(wait):
                return []
            cmds: list[Command] = pickle.loads(self.commands.recv_bytes())
            while self.commands.poll(0):
                cmds.extend(pickle.loads(self.commands.recv_bytes()))
        except (EOFError, OSError):  # the server is gone: stop serving
            return [Stop()]
        return cmds

    def post(self, items: list[tuple[str, StreamItem]]) -> None:
        wire = []
        for rid, item in items:
            if isinstance(item, RequestOutput):
                item = self._slim(rid, item)
            wire.append((rid, _portable(item)))
        self.results.send(("items", wire))

    def _slim(self, rid: str, out: RequestOutput) -> RequestOutput:
        if rid not in self._prompt_sent:
            if not out.finished:
                self._prompt_sent.add(rid)
            return out
        if out.finished:
            self._prompt_sent.discard(rid)
        # prompt_token_ids=None marks the omission (RequestStream fills them back in).
        return dataclasses.replace(out, prompt=None, prompt_token_ids=None,
                                   metrics=out.metrics if out.finished else None)

    def released(self, request_ids: list[str]) -> None:
        self._prompt_sent.difference_update(request_ids)

    def finished(self, metrics: list[RequestMetrics]) -> None:
        self.results.send(("finished", metrics))

    def call_done(self, call_id: int, ok: bool, value: Any) -> None:
        try:
            self.results.send(("call", call_id, ok, _portable(value)))
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            self.results.send(("call", call_id, False,
                               RuntimeError(f"the call's result does not pickle: {e}")))


def _core_main(args: EngineArgs, keep_metrics: bool, log_level: int,
               commands: Connection, results: Connection) -> None:
    """Entry point of the engine-core process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s %(name)s (engine core): %(message)s")
    from conveyor.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(args)
    except BaseException as e:
        results.send(("fatal", f"{type(e).__name__}: {e}"))
        return
    engine.keep_metrics = keep_metrics
    results.send(("ready", engine.config))
    error = EngineLoop(engine, _PipeTransport(commands, results)).run()
    with contextlib.suppress(OSError):  # the server may be gone already
        results.send(("exit", _portable(error)))


class ProcessBackend:
    """Front-end side: spawns the engine-core process and relays through two threads."""

    def __init__(self, args: EngineArgs, *, keep_metrics: bool = True,
                 start_timeout_s: float = 1800.0) -> None:
        self.engine = None  # lives in the child
        ctx = multiprocessing.get_context("spawn")  # never fork a process holding torch threads
        cmd_recv, self._cmd_send = ctx.Pipe(duplex=False)
        self._results, results_send = ctx.Pipe(duplex=False)
        self.process = ctx.Process(
            target=_core_main, name="conveyor-engine-core", daemon=True,
            args=(args, keep_metrics, logging.getLogger().getEffectiveLevel(),
                  cmd_recv, results_send))
        self.process.start()
        cmd_recv.close()  # the child's ends: closing ours lets EOF reach each side
        results_send.close()
        self.info = self._wait_ready(start_timeout_s)
        self._outbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._reader: threading.Thread | None = None

    def _wait_ready(self, timeout_s: float) -> EngineInfo:
        try:
            if not self._results.poll(timeout_s):
                raise EngineCoreStartError(f"the engine core did not start in {timeout_s:g} s")
            msg = self._results.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise EngineCoreStartError(f"the engine core exited while starting "
                                       f"(exit code {self.process.exitcode})") from None
        except BaseException:
            self.close()
            raise
        if msg[0] != "ready":
            self.close()
            raise EngineCoreStartError(f"the engine core could not start: {msg[1]}")
        config = msg[1]
        from conveyor.engine.detokenizer import load_tokenizer

        tokenizer = load_tokenizer(config.model.tokenizer) if config.model.tokenizer else None
        return EngineInfo(config, tokenizer)

    def start(self, sink: EngineSink) -> None:
        self._sender = threading.Thread(target=self._send_loop, args=(sink,),
                                        name="conveyor-core-sender", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, args=(sink,),
                                        name="conveyor-core-reader", daemon=True)
        self._sender.start()
        self._reader.start()

    def send(self, cmd: Command) -> None:
        self._outbox.put(cmd)  # never blocks the event loop; the sender thread may

    def _send_loop(self, sink: EngineSink) -> None:
        while True:
            cmds = [self._outbox.get()]
            while True:
                try:
                    cmds.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            try:
                self._cmd_send.send_bytes(self._pickled(cmds, sink))
            except (OSError, ValueError):
                return  # the child is gone; the reader reports it
            if any(isinstance(c, Stop) for c in cmds):
                return

    @staticmethod
    def _pickled(cmds: list[Command], sink: EngineSink) -> bytes:
        """``cmds`` pickled, less any that cannot cross to the child (each fails alone)."""
        try:
            return pickle.dumps(cmds, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:
            pass
        kept = []
        for cmd in cmds:
            try:
                pickle.dumps(cmd)
            except Exception as e:
                error = TypeError(f"cannot send this to the engine-core process: "
                                  f"{type(e).__name__}: {e}")
                if isinstance(cmd, Call):
                    sink.call_done(cmd.call_id, False, error)
                elif isinstance(cmd, AddRequest):
                    sink.items([(cmd.request_id, error)])
                continue
            kept.append(cmd)
        return pickle.dumps(kept, protocol=pickle.HIGHEST_PROTOCOL)

    def _read_loop(self, sink: EngineSink) -> None:
        error: BaseException | None = None
        try:
            while True:
                msg = self._results.recv()
                kind = msg[0]
                if kind == "items":
                    sink.items(msg[1])
                elif kind == "finished":
                    sink.finished(msg[1])
                elif kind == "call":
                    sink.call_done(msg[1], msg[2], msg[3])
                elif kind == "exit":
                    error = msg[1]
                    break
        except (EOFError, OSError):
            self.process.join(5)
            error = RuntimeError(f"the engine-core process died (exit code "
                                 f"{self.process.exitcode})")
        except BaseException as e:  # an unreadable message: the link cannot be trusted
            logger.exception("reading from the engine core failed")
            error = e
        sink.died(error)

    def join(self, timeout_s: float) -> None:
        self.process.join(timeout_s)
        if self.process.is_alive():
            logger.warning("the engine core did not stop in %g s: terminating it", timeout_s)
            self.process.terminate()
            self.process.join(5)
        if self._reader is not None:
            self._reader.join(5)
        self.close()

    def close(self) -> None:
        """Release the pipes and the process (after ``join``, or if never started)."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        for conn in (self._cmd_send, self._results):
            conn.close()
