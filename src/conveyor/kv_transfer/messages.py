"""What crosses for a KV transfer: the request's handle and the wire messages between a
decode worker and a prefill worker. No torch. (The connector's per-step orders and the
worker's report ride in the scheduler's messages: ``core/kv_connector.py``.)"""

from __future__ import annotations

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
    # The model the prefill computed the K/V with (its body's: the base model's name or
    # an adapter's); a decode request naming another is refused (its K/V would be wrong).
    model: str | None = None

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
