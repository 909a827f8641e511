"""The KV transport: pyzmq over TCP (loopback on one host), one interface for others.

A prefill worker runs a ``KVServer`` (a ROUTER socket, one thread); a decode worker
pulls with ``KVClient`` (a DEALER socket per pull, so pulls run on several threads).
Each message is a msgspec-typed header frame (``messages.WireMessage``, msgpack)
followed, for a pull's reply, by the raw bytes of the K and V of each layer. Bytes
and blocks are counted on both ends. NIXL or Mooncake's transfer engine would be other
implementations of the same two calls (``serve``: answer pulls and dones; ``pull`` /
``notify_done``), reading the paged cache in place on GPUs.

FAULT INJECTION (tests only, not a feature): ``CONVEYOR_KV_FAULT``, read by the server
at start: ``delay:SECONDS`` answers each pull that much later; ``drop`` never answers a
pull (as a connection that went away); ``per-transfer`` lets a transfer id pick its own
fault (``fault-delay-SECONDS-...``, ``fault-drop-...``), so that one test server serves
clean and faulty transfers. Unset (production): no fault, transfer ids mean nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec
import zmq

from conveyor import envs
from conveyor.kv_transfer.messages import (
    DoneAck,
    DoneNotice,
    PullReply,
    PullRequest,
    WireMessage,
)

logger = logging.getLogger(__name__)

FAULT_ENV = envs.KV_FAULT
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(WireMessage).decode


class TransferError(RuntimeError):
    """A pull that did not bring the bytes (timeout, refused, malformed reply)."""


@dataclass(frozen=True)
class FaultInjection:
    delay_s: float = 0.0
    drop: bool = False
    per_transfer: bool = False

    @classmethod
    def from_env(cls) -> FaultInjection:
        spec = envs.kv_fault()
        delay, drop, per = 0.0, False, False
        for part in filter(None, (p.strip() for p in spec.split(","))):
            if part == "drop":
                drop = True
            elif part == "per-transfer":
                per = True
            elif part.startswith("delay:"):
                delay = float(part.split(":", 1)[1])
            else:
                raise ValueError(f"{FAULT_ENV}: unknown fault {part!r} "
                                 f"(delay:SECONDS, drop, per-transfer)")
        if spec:
            logger.warning("KV transport FAULT INJECTION active: %s=%s", FAULT_ENV, spec)
        return cls(delay, drop, per)

    def for_transfer(self, transfer_id: str) -> tuple[float, bool]:
        """(delay in seconds, drop) for this transfer."""
        if self.per_transfer:
            if transfer_id.startswith("fault-drop-"):
                return self.delay_s, True
            if transfer_id.startswith("fault-delay-"):
                with contextlib.suppress(ValueError, IndexError):
                    return float(transfer_id.split("-")[2]), self.drop
        return self.delay_s, self.drop


@dataclass
class TransportCounters:
    """Payload bytes (K/V only, headers not counted) and blocks, this end."""

    bytes: int = 0
    blocks: int = 0


# A pull's answer: the header, then the frames (bytes-like) to send after it.
PullHandler = Callable[[PullRequest], tuple[PullReply, list]]


class PullServer(Protocol):
    """The prefill side of a transport: answers pulls with ``on_pull``'s frames and
    passes done notices to ``on_done``; ``sent`` counts payload bytes."""

    sent: TransportCounters

    def start(self) -> None: ...

    def stop(self) -> None: ...


class PullClient(Protocol):
    """The decode side of a transport; called from several load threads at once."""

    def pull(self, host: str, port: int, transfer_id: str, num_tokens: int,
             timeout_s: float) -> tuple[PullReply, list]: ...

    def notify_done(self, host: str, port: int, transfer_id: str,
                    timeout_s: float = 1.0) -> bool: ...


class KVServer:  # a PullServer
    """Answers pulls and done notices on ``tcp://host:port`` in a thread of its own."""

    def __init__(self, host: str, port: int, on_pull: PullHandler,
                 on_done: Callable[[str], None], fault: FaultInjection | None = None) -> None:
        self.address = f"tcp://{host}:{port}"
        self.on_pull, self.on_done = on_pull, on_done
        self.fault = fault or FaultInjection()
        self.sent = TransportCounters()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.address)  # at construction: a taken port fails the start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conveyor-kv-server",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._sock.close(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        delayed: list[tuple[float, bytes, PullRequest]] = []  # FAULT INJECTION only
        while not self._stop.is_set():
            now = time.monotonic()
            for item in [d for d in delayed if d[0] <= now]:
                delayed.remove(item)
                self._serve_pull(item[1], item[2])
            wait_ms = 100 if not delayed else max(1, min(100, int(
                (min(d[0] for d in delayed) - now) * 1000)))
            if not poller.poll(wait_ms):
                continue
            try:
                ident, header = self._sock.recv_multipart()[:2]
                msg = _decode(header)
            except (ValueError, msgspec.DecodeError) as e:
                logger.warning("KV server: malformed message dropped (%s)", e)
                continue
            if isinstance(msg, PullRequest):
                delay_s, drop = self.fault.for_transfer(msg.transfer_id)
                if drop:
                    continue  # FAULT INJECTION: the reply never leaves
                if delay_s:  # FAULT INJECTION: a slow peer (others are served meanwhile)
                    delayed.append((now + delay_s, ident, msg))
                    continue
                self._serve_pull(ident, msg)
            elif isinstance(msg, DoneNotice):
                self.on_done(msg.transfer_id)
                self._sock.send_multipart([ident, _encode(DoneAck(msg.transfer_id))])

    def _serve_pull(self, ident: bytes, msg: PullRequest) -> None:
        try:
            reply, frames = self.on_pull(msg)
        except Exception as e:  # a bug here must not kill the server: the pull fails
            logger.exception("KV server: serving %s failed", msg.transfer_id)
            reply, frames = PullReply(msg.transfer_id, False, f"{type(e).__name__}: {e}"), []
        self._sock.send_multipart([ident, _encode(reply), *frames], copy=False)
        if reply.ok:
            self.sent.bytes += sum(len(memoryview(f)) for f in frames)


class KVClient:  # a PullClient
    """Pulls from a ``KVServer``; safe to call from several threads (a socket each)."""

    def __init__(self) -> None:
        self._ctx = zmq.Context.instance()

    def _request(self, host: str, port: int, header: bytes, timeout_s: float) -> list:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{host}:{port}")
            sock.send(header)
            if not sock.poll(int(timeout_s * 1000), zmq.POLLIN):
                raise TransferError(f"no answer from {host}:{port} within {timeout_s:.3g} s")
            return sock.recv_multipart(copy=False)
        finally:
            sock.close(linger=0)

    def pull(self, host: str, port: int, transfer_id: str, num_tokens: int,
             timeout_s: float) -> tuple[PullReply, list]:
        """The reply and its ``2 x layers`` frames (zmq Frames: ``.buffer``); raises
        TransferError when none came or the peer refused."""
        parts = self._request(host, port, _encode(PullRequest(transfer_id, num_tokens)),
                              timeout_s)
        try:
            reply = _decode(parts[0].bytes)
        except msgspec.DecodeError as e:
            raise TransferError(f"malformed reply from {host}:{port}: {e}") from None
        if not isinstance(reply, PullReply) or reply.transfer_id != transfer_id:
            raise TransferError(f"unexpected reply from {host}:{port}")
        if not reply.ok:
            raise TransferError(f"the prefill engine refused: {reply.error}")
        if len(parts) - 1 != 2 * reply.num_layers:
            raise TransferError(f"reply has {len(parts) - 1} frames, "
                                f"expected {2 * reply.num_layers}")
        return reply, parts[1:]

    def notify_done(self, host: str, port: int, transfer_id: str,
                    timeout_s: float = 1.0) -> bool:
        """Tell the prefill its lease may end; best effort (the lease expires anyway)."""
        try:
            parts = self._request(host, port, _encode(DoneNotice(transfer_id)), timeout_s)
            return isinstance(_decode(parts[0].bytes), DoneAck)
        except (TransferError, msgspec.DecodeError, zmq.ZMQError):
            return False
