"""The engine core in a process of its own, behind two pipes of typed messages.

    server process (front end, no torch)              engine-core process (spawned)
    ------------------------------------              -----------------------------
    AsyncEngine.send(cmd) -> queue -> sender thread == msgpack([CoreCommand]) ==>  EngineLoop
    AsyncEngine (sink) <- reader thread <== msgpack(CoreMessage), one per post ==  EngineLoop

The child builds the ``EngineCore`` over its executor (``make_executor``: a
``LocalExecutor``, or a tensor-parallel executor driving rank workers), reports its
resolved config (``CoreReady``), then runs the same ``EngineLoop`` a thread would. The
server process loads only the tokenizer: it never imports torch nor runs model code, so
its GIL serves HTTP and the child's serves the model. Everything crossing is a msgspec
``Struct`` of ``messages.py`` (token ids, numbers, short strings): no pickle, no
callable. Commands are queued without blocking the event loop (a full pipe blocks the
sender thread only) and sent in batches; outputs go back once per step.

The child ignores SIGINT (the server decides when to stop and sends ``Shutdown``) and
exits when its command pipe closes, so it never outlives the server.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import queue
import signal
import threading
from multiprocessing.connection import Connection

import msgspec

from conveyor.config import EngineArgs
from conveyor.engine.backend import EngineInfo, EngineSink
from conveyor.engine.engine_loop import EngineLoop, LocalCall, LoopCommand, LoopMessage
from conveyor.engine.messages import (
    AddRequests,
    AddResult,
    CoreExit,
    CoreReady,
    CoreStartFailed,
    ErrorInfo,
    Shutdown,
    UtilityCall,
    UtilityResult,
    command_decoder,
    core_message_decoder,
    encoder,
)

logger = logging.getLogger(__name__)


class EngineCoreStartError(RuntimeError):
    """The engine-core process could not build its engine (bad model, out of memory...)."""


class _PipeTransport:
    """Engine side, in the child: commands from one pipe, messages into the other."""

    def __init__(self, commands: Connection, results: Connection) -> None:
        self.commands = commands
        self.results = results
        self._encode = encoder().encode
        self._decode = command_decoder().decode

    def take(self, wait: float | None) -> list[LoopCommand]:
        try:
            if wait is not None and not self.commands.poll(wait):
                return []
            cmds: list[LoopCommand] = self._decode(self.commands.recv_bytes())
            while self.commands.poll(0):
                cmds.extend(self._decode(self.commands.recv_bytes()))
        except (EOFError, OSError):  # the server is gone: stop serving
            return [Shutdown()]
        return cmds

    def post(self, messages: list[LoopMessage]) -> None:
        for m in messages:
            try:
                data = self._encode(m)
            except (TypeError, msgspec.EncodeError) as e:  # e.g. a utility value
                if not isinstance(m, UtilityResult):
                    raise
                data = self._encode(UtilityResult(m.call_id, False,
                                                  error=ErrorInfo("error", str(e))))
            self.results.send_bytes(data)


def _core_main(args: EngineArgs, log_level: int, commands: Connection,
               results: Connection) -> None:
    """Entry point of the engine-core process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s %(name)s (engine core): %(message)s")
    encode = encoder().encode
    try:
        from conveyor.engine.local_core import build_local_core

        core = build_local_core(args)
    except BaseException as e:
        results.send_bytes(encode(CoreStartFailed(f"{type(e).__name__}: {e}")))
        return
    results.send_bytes(encode(CoreReady(core.config)))
    try:
        error = EngineLoop(core, _PipeTransport(commands, results)).run()
    finally:
        # Tensor-parallel ranks stop with the core; the KV connector closes its socket.
        with contextlib.suppress(Exception):
            core.executor.shutdown()
    with contextlib.suppress(OSError):  # the server may be gone already
        results.send_bytes(encode(CoreExit(None if error is None
                                           else f"{type(error).__name__}: {error}")))


class ProcessBackend:
    """Front-end side: spawns the engine-core process and relays through two threads."""

    accepts_local_calls = False

    def __init__(self, args: EngineArgs, *, start_timeout_s: float = 1800.0) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process holding threads
        cmd_recv, self._cmd_send = ctx.Pipe(duplex=False)
        self._results, results_send = ctx.Pipe(duplex=False)
        # A daemonic process may have no children: an engine core whose tensor-parallel
        # ranks are its processes is not one, and is stopped at exit instead.
        daemon = args.tensor_parallel_size == 1 or args.distributed_executor_backend != "mp"
        self.process = ctx.Process(
            target=_core_main, name="conveyor-engine-core", daemon=daemon,
            args=(args, logging.getLogger().getEffectiveLevel(), cmd_recv, results_send))
        self.process.start()
        if not daemon:
            atexit.register(self.close)  # runs before multiprocessing joins its children
        cmd_recv.close()  # the child's ends: closing ours lets EOF reach each side
        results_send.close()
        self._encode = encoder().encode
        self._decode = core_message_decoder().decode
        self.info = self._wait_ready(start_timeout_s)
        self._outbox: queue.SimpleQueue[LoopCommand] = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._reader: threading.Thread | None = None

    def _wait_ready(self, timeout_s: float) -> EngineInfo:
        try:
            if not self._results.poll(timeout_s):
                raise EngineCoreStartError(f"the engine core did not start in {timeout_s:g} s")
            msg = self._decode(self._results.recv_bytes())
        except (EOFError, OSError):
            self.process.join(5)
            raise EngineCoreStartError(f"the engine core exited while starting "
                                       f"(exit code {self.process.exitcode})") from None
        except BaseException:
            self.close()
            raise
        if not isinstance(msg, CoreReady):
            self.close()
            detail = msg.message if isinstance(msg, CoreStartFailed) else repr(msg)
            raise EngineCoreStartError(f"the engine core could not start: {detail}")
        config = msg.config
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

    def send(self, cmd: LoopCommand) -> None:
        if isinstance(cmd, LocalCall):
            raise TypeError("a callable cannot cross to the engine-core process")
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
                self._cmd_send.send_bytes(self._encoded(cmds, sink))
            except (OSError, ValueError):
                return  # the child is gone; the reader reports it
            if any(isinstance(c, Shutdown) for c in cmds):
                return

    def _encoded(self, cmds: list[LoopCommand], sink: EngineSink) -> bytes:
        """``cmds`` encoded, less any that cannot be (each fails alone, answered here)."""
        try:
            return self._encode(cmds)
        except (TypeError, msgspec.EncodeError):
            pass
        kept = []
        for cmd in cmds:
            try:
                self._encode(cmd)
            except (TypeError, msgspec.EncodeError) as e:
                error = ErrorInfo("invalid", f"cannot send this to the engine core: {e}")
                if isinstance(cmd, UtilityCall):
                    sink.messages([UtilityResult(cmd.call_id, False, error=error)])
                elif isinstance(cmd, AddRequests) and cmd.requests:
                    sink.messages([AddResult(cmd.requests[0].request_id, error)])
                continue
            kept.append(cmd)
        return self._encode(kept)

    def _read_loop(self, sink: EngineSink) -> None:
        error: BaseException | None = None
        try:
            while True:
                msg = self._decode(self._results.recv_bytes())
                if isinstance(msg, CoreExit):
                    error = RuntimeError(msg.error) if msg.error else None
                    break
                sink.messages([msg])
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
