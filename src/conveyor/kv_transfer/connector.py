"""The scheduler-side half of the KV connector (vLLM's ``KVConnectorBase_V1`` scheduler
role). No torch, no clock: ``now`` comes from the scheduler's own calls.

Decode side (a request carrying ``do_remote_prefill``):
    get_num_new_matched_tokens(req)    prompt tokens a peer holds (all but the last)
    update_state_after_alloc(req, now) its blocks are allocated: a load is ordered
    report recv_done / recv_failed     -> the request runs from ``prompt - 1`` tokens, or
                                          the fallback (recompute, or fail the request)
Prefill side (a request carrying ``do_remote_decode``):
    will_save(req)                     its prompt completes this step: serve its K/V
    request_finished(req, now)         its blocks go under a lease instead of being freed
    report send_done / lease expiry    -> the blocks go back to the free list, once

Block ownership: a block is in the free list, held by a request (``req_blocks``), or
held by an in-flight transfer: on the prefill side the lease's blocks sit in
``KVCacheManager.detached``; on the decode side the blocks of a request in
``WAITING_FOR_REMOTE_KV`` belong to its load until it ends (``owned_blocks`` says which).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from conveyor.config import KVTransferConfig
from conveyor.core.kv_cache_manager import KVCacheManager
from conveyor.core.kv_connector import KVConnectorMeta, KVWorkerReport, LoadSpec, SaveSpec
from conveyor.kv_transfer.messages import KVTransferParams
from conveyor.kv_transfer.state import Transfer, TransferTable
from conveyor.request import Request

# Transfer latency buckets (seconds), as Prometheus' default-like 1-2.5-5 steps.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0)


@dataclass
class Histogram:
    """Fixed buckets: nothing grows with the number of transfers."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def as_dict(self) -> dict[str, Any]:
        return {"buckets": list(self.buckets), "counts": list(self.counts),
                "sum": self.total, "count": self.count}


@dataclass
class KVTransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    blocks_sent: int = 0
    blocks_received: int = 0
    loads_ok: int = 0  # decode: loads written into the cache
    loads_failed: int = 0  # decode: loads that failed (peer gone, timeout, bad reply)
    leases_granted: int = 0  # prefill: requests whose blocks went under a lease
    leases_released: int = 0  # prefill: released by the peer's done
    leases_expired: int = 0  # prefill: released by the lease's timeout
    requests_recomputed: int = 0  # decode: fell back to computing the prompt here
    requests_failed: int = 0  # decode: failed with a clear error (fallback "fail")
    latency: Histogram = field(default_factory=Histogram)


class KVConnectorScheduler:
    def __init__(self, config: KVTransferConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.sends = TransferTable()  # prefill: leases, by transfer id
        self.recvs = TransferTable()  # decode: loads, by transfer id
        self._recv_of: dict[str, Transfer] = {}  # request id -> its load
        self._meta = KVConnectorMeta()
        self.stats = KVTransferStats()

    # ---- admission (both roles) ----------------------------------------------------------
    def check_params(self, params: KVTransferParams) -> None:
        """ValueError when this engine cannot serve the request's transfer role."""
        params.check()
        role = self.config.role
        if params.do_remote_decode and role != "prefill":
            raise ValueError(f"do_remote_decode needs a prefill engine (--kv-role prefill); "
                             f"this one is --kv-role {role}")
        if params.do_remote_prefill and role != "decode":
            raise ValueError(f"do_remote_prefill needs a decode engine (--kv-role decode); "
                             f"this one is --kv-role {role}")
        table = self.sends if params.do_remote_decode else self.recvs
        if params.transfer_id in table.transfers:
            raise ValueError(f"transfer id {params.transfer_id!r} is already in use")

    # ---- decode side ---------------------------------------------------------------------
    def get_num_new_matched_tokens(self, req: Request) -> int:
        """Prompt tokens whose K/V a peer holds (0: compute them here). The last prompt
        token is always computed here, so that the first output token is sampled here."""
        p = req.kv_params
        if p is None or not p.do_remote_prefill or req.kv_load_tried:
            return 0
        if p.num_prompt_tokens != req.num_prompt_tokens or req.num_computed_tokens:
            return 0  # another tokenization, or already running: nothing to take
        return req.num_prompt_tokens - 1

    def update_state_after_alloc(self, req: Request, now: float) -> None:
        """``req`` holds blocks for its whole prompt: order the load into them."""
        p = req.kv_params
        assert p is not None and p.remote_host is not None and p.remote_port is not None
        req.kv_load_tried = True
        block_ids = self.kv.block_ids(req.request_id)
        t = Transfer(p.transfer_id, req.request_id, "recv", block_ids, req.num_prompt_tokens,
                     created=now, deadline=now + self.config.transfer_timeout_s)
        self.recvs.add(t)
        self._recv_of[req.request_id] = t
        self._meta.loads.append(LoadSpec(p.transfer_id, p.remote_host, p.remote_port,
                                         block_ids, req.num_prompt_tokens))
        t.start(now)

    def is_loading(self, request_id: str) -> bool:
        return request_id in self._recv_of

    def request_aborted(self, request_id: str, now: float) -> None:
        """A request waiting for remote KV ends (abort): its load is cancelled at once.
        The caller frees its blocks; the worker drops the load before this step runs."""
        t = self._recv_of.pop(request_id, None)
        if t is None:
            return
        t.fail(now, "request aborted")
        self._meta.cancels.append(t.transfer_id)
        self.recvs.drop(t)

    def _end_load(self, t: Transfer, now: float, error: str | None
                  ) -> tuple[str, str | None] | None:
        """READY (error None) or FAILED; the blocks go to the request. Idempotent."""
        if not (t.complete(now) if error is None else t.fail(now, error)):
            return None
        self._recv_of.pop(t.request_id, None)
        self.recvs.drop(t)
        if error is None:
            self.stats.loads_ok += 1
            self.stats.latency.observe(now - t.created)
        else:
            self.stats.loads_failed += 1
            if self.config.fallback == "recompute":
                self.stats.requests_recomputed += 1
            else:
                self.stats.requests_failed += 1
        return t.request_id, error

    # ---- prefill side --------------------------------------------------------------------
    def will_save(self, req: Request) -> None:
        """``req``'s prompt completes in this step: the worker serves it after the forward
        (so the handle is valid before the response leaves the engine)."""
        p = req.kv_params
        if p is not None and p.do_remote_decode:
            self._meta.saves.append(SaveSpec(p.transfer_id, self.kv.block_ids(req.request_id),
                                             req.num_prompt_tokens))

    def request_finished(self, req: Request, now: float) -> bool:
        """True when the request's blocks went under a lease (the caller must not free
        them); False: free them as usual."""
        p = req.kv_params
        if p is None or not p.do_remote_decode or req.request_id not in self.kv.req_blocks:
            return False
        if req.num_computed_tokens < req.num_prompt_tokens:
            return False  # its prompt never completed: nothing to offer
        block_ids = self.kv.detach(req.request_id, p.transfer_id)
        self.sends.add(Transfer(p.transfer_id, req.request_id, "send", block_ids,
                                req.num_prompt_tokens, created=now,
                                deadline=now + self.config.lease_timeout_s))
        self.stats.leases_granted += 1
        return True

    def _end_lease(self, t: Transfer, now: float, error: str | None) -> None:
        if not (t.complete(now) if error is None else t.fail(now, error)):
            return
        self.kv.release_detached(t.transfer_id)
        self._meta.revokes.append(t.transfer_id)
        self.sends.drop(t)
        if error is None:
            self.stats.leases_released += 1
            self.stats.latency.observe(now - t.created)
        else:
            self.stats.leases_expired += 1

    # ---- every step ----------------------------------------------------------------------
    def expire(self, now: float) -> list[tuple[str, str]]:
        """End every transfer past its lease. Returns the decode requests whose load
        failed, (request id, why), for the scheduler's fallback."""
        for t in list(self.sends.transfers.values()):
            if t.expired(now):
                self._end_lease(t, now, f"lease expired after {self.config.lease_timeout_s} s")
        failed = []
        for t in list(self.recvs.transfers.values()):
            if t.expired(now):
                self._meta.cancels.append(t.transfer_id)
                end = self._end_load(
                    t, now, f"no KV from the prefill engine within "
                            f"{self.config.transfer_timeout_s} s")
                if end is not None:
                    failed.append(end)
        return failed

    def build_connector_meta(self) -> KVConnectorMeta | None:
        meta, self._meta = self._meta, KVConnectorMeta()
        return None if meta.is_empty else meta

    def update_from_output(self, report: KVWorkerReport | None, now: float
                           ) -> list[tuple[str, str | None]]:
        """Fold the worker's report in. Returns the decode requests whose load ended,
        (request id, None) when written, (request id, why) when it failed."""
        if report is None:
            return []
        s = self.stats
        s.bytes_sent += report.bytes_sent
        s.bytes_received += report.bytes_received
        s.blocks_sent += report.blocks_sent
        s.blocks_received += report.blocks_received
        for tid in report.send_started:
            t = self.sends.get(tid)
            if t is not None:
                t.start(now)
        for tid in report.send_done:  # a repeat, or after expiry: no-op
            t = self.sends.get(tid)
            if t is not None:
                self._end_lease(t, now, None)
        ended = []
        for tid, error in [*((tid, None) for tid in report.recv_done),
                           *report.recv_failed.items()]:
            t = self.recvs.get(tid)
            if t is not None and (end := self._end_load(t, now, error)) is not None:
                ended.append(end)
        return ended

    def has_work(self) -> bool:
        """Leases or loads held, or orders not yet given: the engine must keep stepping
        (empty steps) so that reports arrive and leases expire."""
        return bool(len(self.sends) or len(self.recvs) or not self._meta.is_empty)

    def owned_blocks(self) -> dict[int, str]:
        """Block id -> the transfer holding it (the invariant check's third owner)."""
        out = {b: t.transfer_id for t in self.sends.transfers.values() for b in t.block_ids}
        for t in self.recvs.transfers.values():
            for b in t.block_ids:
                out[b] = t.transfer_id
        return out

    def stats_dict(self) -> dict[str, Any]:
        s = self.stats
        return {
            "role": self.config.role,
            "bytes_sent": s.bytes_sent, "bytes_received": s.bytes_received,
            "blocks_sent": s.blocks_sent, "blocks_received": s.blocks_received,
            "loads_ok": s.loads_ok, "loads_failed": s.loads_failed,
            "leases_granted": s.leases_granted, "leases_released": s.leases_released,
            "leases_expired": s.leases_expired,
            "requests_recomputed": s.requests_recomputed,
            "requests_failed": s.requests_failed,
            "leases_held": len(self.sends), "loads_in_flight": len(self.recvs),
            "latency_s": s.latency.as_dict(),
        }
