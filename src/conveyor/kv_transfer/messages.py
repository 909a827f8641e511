"""What crosses for a KV transfer: the request's handle, the connector's per-step
metadata (scheduler half -> worker half), the worker's per-step report (back), and the
wire messages between a decode worker and a prefill worker. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec


class KVTransferParams(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """A request's ``kv_transfer_params`` (vLLM's name, in the OpenAI request body).

    To a prefill engine: ``do_remote_decode`` and the ``transfer_id`` the proxy chose; its
    response carries the handle back (with ``remote_host``/``remote_port`` and the prompt
    length). To a decode engine: ``do_remote_prefill`` and that handle."""

    transfer_id: str
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_host: str | None = None
    remote_port: int | None = None
    num_prompt_tokens: int | None = None

    def check(self) -> None:
        """ValueError naming what is wrong (the server answers 400)."""
        if not self.transfer_id:
            raise ValueError("kv_transfer_params.transfer_id must be a non-empty string")
        if self.do_remote_decode == self.do_remote_prefill:
            raise ValueError("kv_transfer_params: exactly one of do_remote_decode and "
                             "do_remote_prefill must be true")
        if self.do_remote_prefill and (self.remote_host is None or self.remote_port is None
                                       or self.num_prompt_tokens is None):
            raise ValueError("kv_transfer_params with do_remote_prefill needs remote_host, "
                             "remote_port and num_prompt_tokens (the prefill's handle)")


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


# ---- wire (decode worker <-> prefill worker, over transport.py) ---------------------------
class PullRequest(msgspec.Struct, tag=True):
    transfer_id: str
    num_tokens: int


class PullReply(msgspec.Struct, tag=True):
    """Followed by ``2 * num_layers`` frames (K then V of each layer), each
    ``num_tokens x num_kv_heads x head_dim`` values of ``dtype``, when ``ok``."""

    transfer_id: str
    ok: bool
    error: str | None = None
    num_layers: int = 0
    num_tokens: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: str = ""


class DoneNotice(msgspec.Struct, tag=True):
    """The decode side holds the bytes (or gave up): the lease may end. Idempotent."""

    transfer_id: str


class DoneAck(msgspec.Struct, tag=True):
    transfer_id: str


WireMessage = PullRequest | PullReply | DoneNotice | DoneAck
