"""The scheduler's side of a KV connector (prefill/decode disaggregation): the per-step
orders it hands the worker half, the worker's report back, and the methods the
scheduler calls. Defined in the core because they ride in ``SchedulerOutput`` and
``ModelRunnerOutput``; ``conveyor.kv_transfer`` implements the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from conveyor.config import KVTransferConfig
from conveyor.request import Request

# stop_reason of a request failed because its KV transfer failed (--kv-transfer-fallback fail)
KV_TRANSFER_FAILED = "kv_transfer_failed"


@dataclass
class LoadSpec:
    """Decode side: pull ``num_tokens`` tokens' K/V of ``transfer_id`` into ``block_ids``."""

    transfer_id: str
    host: str
    port: int
    block_ids: list[int]
    num_tokens: int


@dataclass
class SaveSpec:
    """Prefill side: after this step's forward, serve ``num_tokens`` tokens' K/V from
    ``block_ids`` as ``transfer_id`` (until revoked)."""

    transfer_id: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class KVConnectorMeta:
    """The scheduler half's orders for one step (vLLM's ``build_connector_meta``).

    The worker applies ``cancels`` and ``revokes`` before anything else in the step: the
    blocks behind them may already belong to another request of this very step."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # loads to drop (aborted, expired)
    revokes: list[str] = field(default_factory=list)  # saves to stop serving (lease over)

    @property
    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.cancels or self.revokes)


@dataclass
class KVWorkerReport:
    """What the worker half saw since the last step (vLLM's ``get_finished``)."""

    recv_done: list[str] = field(default_factory=list)  # loads written into the cache
    recv_failed: dict[str, str] = field(default_factory=dict)  # transfer id -> why
    send_started: list[str] = field(default_factory=list)  # a peer began a pull
    send_done: list[str] = field(default_factory=list)  # a peer confirmed (may repeat)
    bytes_sent: int = 0
    bytes_received: int = 0
    blocks_sent: int = 0
    blocks_received: int = 0

    @property
    def is_empty(self) -> bool:
        return not (self.recv_done or self.recv_failed or self.send_started
                    or self.send_done or self.bytes_sent or self.bytes_received)


class SchedulerKVConnector(Protocol):
    """What the scheduler calls of a KV connector's scheduler half (``conveyor.kv_transfer
    .connector.KVConnectorScheduler``). No clock: ``now`` comes with each call."""

    config: KVTransferConfig

    def get_num_new_matched_tokens(self, req: Request) -> int:
        """Prompt tokens a peer holds for ``req`` (0: compute it here)."""
        ...

    def update_state_after_alloc(self, req: Request, now: float) -> None:
        """``req``'s blocks are allocated: order its load."""
        ...

    def is_loading(self, request_id: str) -> bool: ...

    def request_aborted(self, request_id: str, now: float) -> None: ...

    def will_save(self, req: Request) -> None:
        """``req``'s prompt completes this step: serve its K/V."""
        ...

    def request_finished(self, req: Request, now: float) -> bool:
        """``req`` finished; True when a lease keeps its blocks."""
        ...

    def expire(self, now: float) -> list[tuple[str, str]]:
        """Loads that timed out: (request id, why)."""
        ...

    def build_connector_meta(self) -> KVConnectorMeta | None: ...

    def update_from_output(self, report: KVWorkerReport | None, now: float
                           ) -> list[tuple[str, str | None]]:
        """Loads that ended with this report: (request id, None or why it failed)."""
        ...

    def has_work(self) -> bool: ...

    def owned_blocks(self) -> dict[int, str]:
        """Blocks held by in-flight transfers: block id -> transfer id."""
        ...
