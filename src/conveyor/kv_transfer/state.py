"""One KV transfer's state machine and its lease (no torch, no clock: ``now`` comes in).

    ALLOCATED --> TRANSFERRING --> READY ----> FREED
        |              |                      ^
        +--------------+------> FAILED -------+

A transfer owns a set of KV blocks from ALLOCATED until FREED: on the prefill side the
finished request's blocks, leased to the peer that will pull them; on the decode side the
blocks allocated for a request whose K/V arrives from a peer. Every transfer carries a
deadline (its lease): past it, a transfer still ALLOCATED or TRANSFERRING fails.
Completion is idempotent: the first outcome (READY or FAILED) wins, a repeat or a late
outcome of a finished transfer is a no-op that returns False.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class TransferState(enum.Enum):
    ALLOCATED = "allocated"  # blocks held, nothing moved yet
    TRANSFERRING = "transferring"  # bytes on the wire
    READY = "ready"  # the bytes arrived (decode) or the peer confirmed them (prefill)
    FAILED = "failed"  # timed out, lease expired, peer gone, aborted
    FREED = "freed"  # blocks handed on (to the request, or back to the free list)


_NEXT: dict[TransferState, frozenset[TransferState]] = {
    TransferState.ALLOCATED: frozenset({TransferState.TRANSFERRING, TransferState.READY,
                                        TransferState.FAILED}),
    TransferState.TRANSFERRING: frozenset({TransferState.READY, TransferState.FAILED}),
    TransferState.READY: frozenset({TransferState.FREED}),
    TransferState.FAILED: frozenset({TransferState.FREED}),
    TransferState.FREED: frozenset(),
}
_OUTCOMES = frozenset({TransferState.READY, TransferState.FAILED})


class InvalidTransition(RuntimeError):
    """A move the state machine does not have (a bug, never a peer's doing)."""


@dataclass
class Transfer:
    transfer_id: str
    request_id: str
    role: str  # "send" (prefill: blocks leased to a peer) | "recv" (decode: blocks loading)
    block_ids: list[int]
    num_tokens: int
    created: float
    deadline: float  # the lease: past it, an unfinished transfer fails
    state: TransferState = TransferState.ALLOCATED
    error: str | None = None
    started: float | None = None
    finished: float | None = None

    @property
    def live(self) -> bool:
        """Still waiting for an outcome."""
        return self.state in (TransferState.ALLOCATED, TransferState.TRANSFERRING)

    def start(self, now: float) -> bool:
        if self.state is not TransferState.ALLOCATED:
            return False  # a repeat, or it already ended
        self._move(TransferState.TRANSFERRING)
        self.started = now
        return True

    def complete(self, now: float) -> bool:
        """Idempotent: True only for the call that made it READY."""
        if not self.live:
            return False
        self._move(TransferState.READY)
        self.finished = now
        return True

    def fail(self, now: float, error: str) -> bool:
        """Idempotent: True only for the call that made it FAILED."""
        if not self.live:
            return False
        self._move(TransferState.FAILED)
        self.error = error
        self.finished = now
        return True

    def free(self) -> None:
        """The blocks leave the transfer; only after an outcome, exactly once."""
        if self.state not in _OUTCOMES:
            raise InvalidTransition(f"transfer {self.transfer_id}: free in {self.state.value}")
        self._move(TransferState.FREED)

    def expired(self, now: float) -> bool:
        return self.live and now >= self.deadline

    def _move(self, new: TransferState) -> None:
        if new not in _NEXT[self.state]:
            raise InvalidTransition(
                f"transfer {self.transfer_id}: {self.state.value} -> {new.value}")
        self.state = new


@dataclass
class TransferTable:
    """The live transfers of one side, by transfer id; FREED ones are dropped."""

    transfers: dict[str, Transfer] = field(default_factory=dict)

    def add(self, t: Transfer) -> None:
        if t.transfer_id in self.transfers:
            raise ValueError(f"transfer id {t.transfer_id!r} is already in use")
        self.transfers[t.transfer_id] = t

    def get(self, transfer_id: str) -> Transfer | None:
        return self.transfers.get(transfer_id)

    def expire(self, now: float) -> list[Transfer]:
        """Fail every transfer past its lease; returns them (now FAILED)."""
        out = [t for t in self.transfers.values() if t.expired(now)]
        for t in out:
            t.fail(now, f"lease expired after {t.deadline - t.created:.3g} s")
        return out

    def drop(self, t: Transfer) -> None:
        t.free()
        del self.transfers[t.transfer_id]

    def held_block_ids(self) -> list[int]:
        return [b for t in self.transfers.values() for b in t.block_ids]

    def __len__(self) -> int:
        return len(self.transfers)
