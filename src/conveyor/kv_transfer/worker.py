"""The worker-side half of the KV connector (vLLM's ``KVConnectorBase_V1`` worker role),
in the executor beside the model runner. It reads and writes the paged KV tensors by
block id: each layer's K and V are ``[num_blocks * block_size, kv_heads, head_dim]``
(``ModelRunner.allocate_kv_cache``), token ``t`` of a request in slot
``block_ids[t // block_size] * block_size + t % block_size``.

Only the prompt tokens' slots travel (not whole padded blocks): a transfer of ``n``
tokens moves exactly ``2 x layers x n x kv_heads x head_dim x dtype bytes``.

Per step (``LocalExecutor.execute_model``):
    start_load_kv(meta)   cancels and revokes first; new loads go to background threads;
                          loads that arrived are written into the cache (this thread
                          only: a cancelled load never writes, the forward never races)
    (the forward)
    wait_for_save(meta)   prompts completed this step are registered for peers to pull
    get_finished()        the report: loads written or failed, pulls served, bytes
A pull is served on the KV server's thread, reading a registered transfer's slots under
a lock that revocation also takes, so a lease that ends never serves reused blocks.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from conveyor.config import KVTransferConfig
from conveyor.core.kv_connector import KVConnectorMeta, KVWorkerReport, LoadSpec
from conveyor.kv_transfer.messages import PullReply, PullRequest
from conveyor.kv_transfer.transport import (
    FaultInjection,
    KVClient,
    KVServer,
    PullClient,
    PullServer,
    TransferError,
)

logger = logging.getLogger(__name__)

_LOAD_THREADS = 4


@dataclass
class _Saved:
    slots: torch.Tensor
    num_tokens: int
    num_blocks: int


def _raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes, any dtype (numpy has no bfloat16: go through uint8)."""
    return t.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def token_slots(block_ids: list[int], num_tokens: int, block_size: int) -> torch.Tensor:
    """The cache rows of a request's first ``num_tokens`` tokens."""
    t = torch.arange(num_tokens)
    blocks = torch.tensor(block_ids, dtype=torch.long)
    return blocks[t // block_size] * block_size + t % block_size


class KVConnectorWorker:
    def __init__(self, config: KVTransferConfig, block_size: int,
                 fault: FaultInjection | None = None) -> None:
        self.config = config
        self.block_size = block_size
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._lock = threading.Lock()  # guards _saved and the server-side report lists
        self._saved: dict[str, _Saved] = {}
        self._send_started: list[str] = []
        self._send_done: list[str] = []
        self._blocks_sent = 0
        self._bytes_sent_reported = 0
        self._loads: dict[str, tuple[LoadSpec, Future]] = {}
        self._report = KVWorkerReport()
        # The transport (pyzmq here; NIXL or Mooncake would be other PullServer/PullClient).
        self.server: PullServer | None = None
        if config.role == "prefill":
            assert config.port is not None
            self.server = KVServer(config.host, config.port, self._serve_pull, self._on_done,
                                   fault if fault is not None else FaultInjection.from_env())
        self.client: PullClient = KVClient()
        self._pool = ThreadPoolExecutor(_LOAD_THREADS, thread_name_prefix="conveyor-kv-load")

    # ---- set-up --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kv_caches = kv_caches
        if self.server is not None:
            self.server.start()

    def shutdown(self) -> None:
        if self.server is not None:
            self.server.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- the step ------------------------------------------------------------------------
    def start_load_kv(self, meta: KVConnectorMeta | None) -> None:
        if meta is not None:
            for tid in meta.cancels:
                self._loads.pop(tid, None)  # its thread's result is discarded
            if meta.revokes:
                with self._lock:
                    for tid in meta.revokes:
                        self._saved.pop(tid, None)
            for spec in meta.loads:
                fut = self._pool.submit(self._pull, spec)
                self._loads[spec.transfer_id] = (spec, fut)
        for tid in [tid for tid, (_, fut) in self._loads.items() if fut.done()]:
            spec, fut = self._loads.pop(tid)
            try:
                reply, frames = fut.result()
                self._write(spec, reply, frames)
            except (TransferError, ValueError) as e:
                self._report.recv_failed[tid] = str(e)
                continue
            self._report.recv_done.append(tid)

    def wait_for_save(self, meta: KVConnectorMeta | None) -> None:
        """After the forward: this step's completed prompts can be pulled."""
        if meta is None or not meta.saves:
            return
        with self._lock:
            for s in meta.saves:
                self._saved[s.transfer_id] = _Saved(
                    token_slots(s.block_ids, s.num_tokens, self.block_size), s.num_tokens,
                    -(-s.num_tokens // self.block_size))

    def get_finished(self) -> KVWorkerReport | None:
        report, self._report = self._report, KVWorkerReport()
        with self._lock:
            report.send_started, self._send_started = self._send_started, []
            report.send_done, self._send_done = self._send_done, []
            report.blocks_sent, self._blocks_sent = self._blocks_sent, 0
        if self.server is not None:
            total = self.server.sent.bytes
            report.bytes_sent = total - self._bytes_sent_reported
            self._bytes_sent_reported = total
        return None if report.is_empty else report

    # ---- decode side ---------------------------------------------------------------------
    def _pull(self, spec: LoadSpec) -> tuple[PullReply, list]:
        """On a load thread: fetch the bytes, then release the peer's lease (best effort)."""
        try:
            return self.client.pull(spec.host, spec.port, spec.transfer_id, spec.num_tokens,
                                    self.config.transfer_timeout_s)
        finally:
            self.client.notify_done(spec.host, spec.port, spec.transfer_id)

    def _write(self, spec: LoadSpec, reply: PullReply, frames: list) -> None:
        k0 = self.kv_caches[0][0]
        want = (len(self.kv_caches), spec.num_tokens, k0.shape[1], k0.shape[2], str(k0.dtype))
        got = (reply.num_layers, reply.num_tokens, reply.num_kv_heads, reply.head_dim,
               reply.dtype)
        if got != want:
            raise ValueError(f"incompatible KV from the prefill engine: layers, tokens, kv "
                             f"heads, head dim, dtype {got}, expected {want}")
        slots = token_slots(spec.block_ids, spec.num_tokens, self.block_size)
        shape = (spec.num_tokens, k0.shape[1], k0.shape[2])
        for i, (k, v) in enumerate(self.kv_caches):
            for cache, frame in ((k, frames[2 * i]), (v, frames[2 * i + 1])):
                data = torch.frombuffer(bytearray(frame.buffer), dtype=k0.dtype)
                if data.numel() != spec.num_tokens * shape[1] * shape[2]:
                    raise ValueError("a KV frame has the wrong size")
                cache.index_copy_(0, slots.to(cache.device), data.view(shape).to(cache.device))
        self._report.bytes_received += sum(len(f.buffer) for f in frames)
        self._report.blocks_received += len(spec.block_ids)

    # ---- prefill side (the KV server's thread) -------------------------------------------
    def _serve_pull(self, req: PullRequest) -> tuple[PullReply, list]:
        with self._lock:
            saved = self._saved.get(req.transfer_id)
            if saved is None:
                return PullReply(req.transfer_id, False,
                                 f"unknown transfer {req.transfer_id!r}: never prefilled here, "
                                 f"or its lease ended (released or expired)"), []
            if req.num_tokens != saved.num_tokens:
                return PullReply(req.transfer_id, False,
                                 f"asked for {req.num_tokens} tokens, the prompt has "
                                 f"{saved.num_tokens}"), []
            self._send_started.append(req.transfer_id)
            frames = []
            for k, v in self.kv_caches:
                frames.append(_raw(k.index_select(0, saved.slots)))
                frames.append(_raw(v.index_select(0, saved.slots)))
            self._blocks_sent += saved.num_blocks
        k0 = self.kv_caches[0][0]
        return PullReply(req.transfer_id, True, None, len(self.kv_caches), saved.num_tokens,
                         k0.shape[1], k0.shape[2], str(k0.dtype)), frames

    def _on_done(self, transfer_id: str) -> None:
        with self._lock:
            self._send_done.append(transfer_id)
