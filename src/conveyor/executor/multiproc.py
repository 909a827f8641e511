"""Tensor-parallel ranks as spawned processes on this machine (the ``mp`` backend).

One process per rank, each with a duplex pipe to the executor: commands go to every
rank, every rank answers. The executor waits on the pipes and on the processes'
sentinels together, so a rank that exits (kill -9 included) is noticed at once, not
at the gloo timeout. The ranks rendezvous on a free loopback port (rank 0's TCP store).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import time
import weakref
from multiprocessing.connection import Connection, wait

from conveyor.config import EngineArgs
from conveyor.executor.tp import START_TIMEOUT_S, TensorParallelExecutor
from conveyor.executor.tp_messages import (
    ShutdownWorker,
    WorkerCommand,
    WorkerFailed,
    WorkerReply,
    encode,
    reply_decoder,
)
from conveyor.executor.tp_worker import free_port, worker_main


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "its pipe closed"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exit code {code}"


def _kill(procs: list, conns: list[Connection]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5)
    for c in conns:
        c.close()


class MultiprocExecutor(TensorParallelExecutor):
    def __init__(self, args: EngineArgs) -> None:
        super().__init__(args)
        ctx = multiprocessing.get_context("spawn")  # never fork a process holding threads
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.procs: list = []
        self.conns: list[Connection] = []
        for rank in range(self.world_size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=worker_main, args=(args, rank, init_method, child),
                               name=f"conveyor-tp-rank{rank}", daemon=True)
            proc.start()
            child.close()  # the worker's end: closing ours lets EOF reach each side
            self.procs.append(proc)
            self.conns.append(parent)
        # Ranks must not outlive an executor nobody shut down (a dropped LLM).
        self._finalizer = weakref.finalize(self, _kill, self.procs, self.conns)
        self._ready(self._gather(START_TIMEOUT_S, "start"))

    def _call(self, cmd: WorkerCommand, timeout_s: float, what: str) -> list[WorkerReply]:
        self._check_alive()
        data = encode(cmd)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except (OSError, ValueError):
                self._fail(f"rank {rank} is gone ({_describe_exit(self.procs[rank].exitcode)})")
        return self._gather(timeout_s, what)

    def _gather(self, timeout_s: float, what: str) -> list[WorkerReply]:
        replies: list[WorkerReply | None] = [None] * self.world_size
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout_s
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(f"rank(s) {sorted(pending)} did not answer {what} within "
                           f"{timeout_s:g} s")
            conns = {self.conns[r]: r for r in pending}
            ready = wait([*conns, *sentinels], timeout=left)
            # Replies first: a rank that reported its error and exited is named by it.
            for obj in sorted(ready, key=lambda o: o not in conns):
                if obj in conns:
                    rank = conns[obj]
                    try:
                        reply = reply_decoder(obj.recv_bytes())
                    except (EOFError, OSError):  # its end closed: it is exiting
                        self.procs[rank].join(5)
                        self._fail(f"rank {rank} died during {what} "
                                   f"({_describe_exit(self.procs[rank].exitcode)})")
                    if isinstance(reply, WorkerFailed):
                        self._fail(reply.message)
                    replies[rank] = reply
                    pending.discard(rank)
                elif obj in sentinels:
                    rank = sentinels[obj]
                    self._fail(f"rank {rank} died during {what} "
                               f"({_describe_exit(self.procs[rank].exitcode)})")
        return replies  # type: ignore[return-value]

    def check_health(self) -> None:
        self._check_alive()
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                self._fail(f"rank {rank} died ({_describe_exit(proc.exitcode)})")

    def _stop_ranks(self, graceful: bool) -> None:
        if graceful:
            data = encode(ShutdownWorker())
            for conn in self.conns:
                with contextlib.suppress(OSError, ValueError):
                    conn.send_bytes(data)
            for proc in self.procs:
                proc.join(10)
        self._finalizer()  # kills what is left, closes the pipes (once)
