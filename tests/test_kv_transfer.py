"""The KV connector without processes: the transfer state machine; the scheduler half
under random sequences of loads, leases, reports, duplicates, expiries and aborts (block
ownership and the free count checked throughout); the worker half's bytes over a real
loopback zmq socket; and two in-process engines (a load held back blocks no other
request)."""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.config import KVTransferConfig
from conveyor.core.kv_connector import (
    KV_TRANSFER_FAILED,
    KVConnectorMeta,
    KVWorkerReport,
    LoadSpec,
    SaveSpec,
)
from conveyor.core.scheduler_output import ModelRunnerOutput
from conveyor.kv_transfer.connector import KVConnectorScheduler
from conveyor.kv_transfer.messages import KVTransferParams
from conveyor.kv_transfer.state import InvalidTransition, Transfer, TransferState
from conveyor.kv_transfer.worker import KVConnectorWorker
from conveyor.request import RequestStatus

from helpers import fake_execute, make_request, make_scheduler
from server_helpers import free_port


# ---- the state machine ---------------------------------------------------------------------
def test_transfer_states_and_idempotent_outcomes():
    t = Transfer("t", "r", "recv", [1, 2], 10, created=0.0, deadline=5.0)
    assert t.start(1.0) and not t.start(1.5)  # a repeat is a no-op
    assert t.state is TransferState.TRANSFERRING
    assert not t.expired(4.9) and t.expired(5.0)
    assert t.complete(2.0) and not t.complete(2.1) and not t.fail(2.2, "late")
    assert t.state is TransferState.READY and t.error is None
    t.free()
    assert t.state is TransferState.FREED
    with pytest.raises(InvalidTransition):
        t.free()  # freed once
    u = Transfer("u", "r", "send", [3], 4, created=0.0, deadline=1.0)
    with pytest.raises(InvalidTransition):
        u.free()  # no outcome yet: its blocks cannot leave
    assert u.fail(1.0, "lease expired") and not u.complete(1.1)
    assert u.state is TransferState.FAILED and not u.expired(9.0)


# ---- the scheduler half, property-tested ---------------------------------------------------
NUM_BLOCKS, BLOCK = 48, 4
OPS = ("add_load", "add_lease", "add_plain", "step", "step", "recv_done", "recv_fail",
       "send_started", "send_done", "dup", "abort", "advance")


def _connector_scheduler(fallback: str):
    sched = make_scheduler(num_blocks=NUM_BLOCKS, block_size=BLOCK, max_num_seqs=4,
                           max_num_batched_tokens=24)
    cfg = KVTransferConfig(role="decode", lease_timeout_s=5.0, transfer_timeout_s=3.0,
                           fallback=fallback)
    sched.connector = KVConnectorScheduler(cfg, sched.kv)
    return sched


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 7)), max_size=60),
       fallback=st.sampled_from(["recompute", "fail"]))
def test_block_ownership_under_random_transfers(ops, fallback):
    sched = _connector_scheduler(fallback)
    conn = sched.connector
    now, n = 0.0, 0
    report = KVWorkerReport()
    ended: list[str] = []  # transfer ids that had an outcome (for duplicates)
    all_reqs = []

    def step():
        nonlocal report
        out = sched.schedule(now)
        run = fake_execute(out)
        run.kv_report, report = report, KVWorkerReport()
        sched.update(out, run, now)
        sched.check_invariants()  # includes: each block in exactly one owner

    for op, k in ops:
        live_loads = list(conn.recvs.transfers)
        live_leases = list(conn.sends.transfers)
        if op in ("add_load", "add_lease", "add_plain"):
            n += 1
            tid = f"t{n}"
            if op == "add_load":
                kv = KVTransferParams(tid, do_remote_prefill=True, remote_host="h",
                                      remote_port=1, num_prompt_tokens=3 + 5 * k % 17)
                req = make_request(f"r{n}", 3 + 5 * k % 17, 1 + k, arrival=now, kv_params=kv)
            elif op == "add_lease":
                req = make_request(f"r{n}", 2 + 3 * k, 1, arrival=now,
                                   kv_params=KVTransferParams(tid, do_remote_decode=True))
            else:
                req = make_request(f"r{n}", 1 + 4 * k, 1 + k, arrival=now)
            sched.add_request(req, now)
            all_reqs.append(req)
        elif op == "step":
            step()
            now += 0.5
        elif op == "recv_done" and live_loads:
            tid = live_loads[k % len(live_loads)]
            report.recv_done.append(tid)
            ended.append(tid)
        elif op == "recv_fail" and live_loads:
            tid = live_loads[k % len(live_loads)]
            report.recv_failed[tid] = "peer gone"
            ended.append(tid)
        elif op == "send_started" and live_leases:
            report.send_started.append(live_leases[k % len(live_leases)])
        elif op == "send_done" and live_leases:
            tid = live_leases[k % len(live_leases)]
            report.send_done.append(tid)
            ended.append(tid)
        elif op == "dup" and ended:  # a repeated or late outcome: a no-op
            tid = ended[k % len(ended)]
            report.recv_done.append(tid)
            report.send_done.append(tid)
            report.recv_failed[tid] = "late"
        elif op == "abort" and sched.requests:
            # Half the time a request whose K/V is loading, when there is one.
            pool = sorted(sched._remote) if k % 2 == 0 and sched._remote else \
                sorted(sched.requests)
            rid = pool[k // 2 % len(pool)]
            sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            sched.check_invariants()
        elif op == "advance":
            now += 4.0  # past the load timeout; twice, past the lease
    # Nothing more arrives: every request must still end (no hang) and every block return.
    now += 100.0
    for _ in range(400):
        if not sched.has_unfinished():
            break
        step()
        now += 1.0
    assert not sched.has_unfinished()
    assert all(r.status.is_finished for r in all_reqs)
    for r in all_reqs:
        if r.status is RequestStatus.FINISHED_ABORTED and r.stop_reason is not None:
            assert fallback == "fail" and r.stop_reason.startswith(KV_TRANSFER_FAILED)
    assert sched.kv.num_free_blocks == NUM_BLOCKS
    assert not sched.kv.detached and not sched.kv.req_blocks
    assert len(conn.recvs) == 0 and len(conn.sends) == 0
    s = conn.stats
    assert s.leases_granted == s.leases_released + s.leases_expired
    assert s.loads_failed == s.requests_recomputed + s.requests_failed


def test_load_then_run_from_last_prompt_token():
    """A load that lands: the request computes exactly one prompt token (its last)."""
    sched = _connector_scheduler("recompute")
    kv = KVTransferParams("a", do_remote_prefill=True, remote_host="h", remote_port=1,
                          num_prompt_tokens=10)
    req = make_request("r", 10, 3, kv_params=kv)
    sched.add_request(req, 0.0)
    out = sched.schedule(0.0)
    assert out.is_empty and req.status is RequestStatus.WAITING_FOR_REMOTE_KV
    (load,) = out.kv_connector_meta.loads
    assert load.num_tokens == 10 and load.block_ids == sched.kv.block_ids("r")
    sched.update(out, ModelRunnerOutput(kv_report=KVWorkerReport(recv_done=["a"])), 0.1)
    out = sched.schedule(0.2)
    assert out.num_scheduled_tokens == {"r": 1} and out.new_reqs[0].num_computed_tokens == 9
    assert sched.stats.num_prompt_tokens_computed == 1
    sched.update(out, fake_execute(out), 0.3)
    sched.check_invariants()


def test_lease_keeps_blocks_until_done_then_frees_once():
    sched = _connector_scheduler("recompute")
    req = make_request("p", 9, 1, kv_params=KVTransferParams("s", do_remote_decode=True))
    sched.add_request(req, 0.0)
    out = sched.schedule(0.0)
    (save,) = out.kv_connector_meta.saves  # registered in the step computing the prompt
    assert save.num_tokens == 9 and len(save.block_ids) == 3
    sched.update(out, fake_execute(out), 0.1)
    assert req.status.is_finished and sched.kv.num_free_blocks == NUM_BLOCKS - 3
    assert sched.has_unfinished()  # the lease keeps the engine stepping
    revokes = []
    for i in range(2):  # done twice: the second is a no-op
        out = sched.schedule(0.2 + i)
        if out.kv_connector_meta is not None:
            revokes += out.kv_connector_meta.revokes
        sched.update(out, ModelRunnerOutput(kv_report=KVWorkerReport(send_done=["s"])), 0.3 + i)
        assert sched.kv.num_free_blocks == NUM_BLOCKS
    out = sched.schedule(3.0)
    revokes += out.kv_connector_meta.revokes if out.kv_connector_meta else []
    assert revokes == ["s"]  # the worker stops serving it before the blocks are reused
    assert sched.connector.stats.leases_released == 1 and not sched.has_unfinished()


# ---- the worker half over a real loopback socket ------------------------------------------
def _caches(num_layers=3, slots=64, heads=2, dim=8, fill=True):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(slots, heads, dim, generator=g) if fill else torch.zeros(slots, heads,
                                                                                    dim),
             torch.randn(slots, heads, dim, generator=g) if fill else torch.zeros(slots, heads,
                                                                                    dim))
            for _ in range(num_layers)]


def _wait_report(worker, meta=None, timeout_s=60.0) -> KVWorkerReport:
    """Polls until a load finished (written or failed); the deadline is only a failsafe."""
    deadline = time.monotonic() + timeout_s
    total = KVWorkerReport()
    worker.start_load_kv(meta)
    while time.monotonic() < deadline:
        r = worker.get_finished()
        if r is not None:
            total.recv_done += r.recv_done
            total.recv_failed.update(r.recv_failed)
            total.bytes_received += r.bytes_received
            total.blocks_received += r.blocks_received
            if total.recv_done or total.recv_failed:
                return total
        time.sleep(0.01)
        worker.start_load_kv(None)
    raise AssertionError("no load finished")


def _wait_sent(worker, transfer_id: str, timeout_s=60.0) -> KVWorkerReport:
    """Polls the serving side until the peer's done notice for ``transfer_id`` arrived (the
    pull's reply reached the peer before it); the deadline is only a failsafe."""
    deadline = time.monotonic() + timeout_s
    total = KVWorkerReport()
    while time.monotonic() < deadline:
        r = worker.get_finished()
        if r is not None:
            total.send_done += r.send_done
            total.bytes_sent += r.bytes_sent
            if transfer_id in total.send_done:
                return total
        time.sleep(0.01)
    raise AssertionError(f"no done notice for {transfer_id!r}")


def test_worker_pull_moves_exactly_the_prompt_slots():
    port, bs = free_port(), 4
    pre = KVConnectorWorker(KVTransferConfig(role="prefill", port=port), bs)
    dec = KVConnectorWorker(KVTransferConfig(role="decode", transfer_timeout_s=5.0), bs)
    src, dst = _caches(), _caches(fill=False)
    pre.register_kv_caches(src)
    dec.register_kv_caches(dst)
    try:
        pre.wait_for_save(KVConnectorMeta(saves=[SaveSpec("x", [5, 2, 9], 10)]))
        meta = KVConnectorMeta(loads=[LoadSpec("x", "127.0.0.1", port, [1, 7, 3], 10)])
        rep = _wait_report(dec, meta)
        assert rep.recv_done == ["x"] and not rep.recv_failed
        assert rep.bytes_received == 2 * 3 * 10 * 2 * 8 * 4 and rep.blocks_received == 3
        src_slots = [b * bs + i for b in (5, 2, 9) for i in range(bs)][:10]
        dst_slots = [b * bs + i for b in (1, 7, 3) for i in range(bs)][:10]
        for (sk, sv), (dk, dv) in zip(src, dst):
            assert torch.equal(dk[dst_slots], sk[src_slots])
            assert torch.equal(dv[dst_slots], sv[src_slots])
            untouched = [i for i in range(dk.shape[0]) if i not in dst_slots]
            assert dk[untouched].abs().sum() == 0 and dv[untouched].abs().sum() == 0
        sent = _wait_sent(pre, "x")
        assert sent.bytes_sent == rep.bytes_received and sent.send_done == ["x"]
        # A revoked transfer is refused, a clear error, no bytes.
        pre.start_load_kv(KVConnectorMeta(revokes=["x"]))
        rep = _wait_report(dec, KVConnectorMeta(loads=[LoadSpec("x", "127.0.0.1", port,
                                                                [1, 7, 3], 10)]))
        assert "unknown transfer" in rep.recv_failed["x"] and rep.bytes_received == 0
    finally:
        pre.shutdown()
        dec.shutdown()


def test_worker_cancelled_load_never_writes():
    port, bs = free_port(), 4
    os.environ["CONVEYOR_KV_FAULT"] = "per-transfer"
    try:
        pre = KVConnectorWorker(KVTransferConfig(role="prefill", port=port), bs)
    finally:
        del os.environ["CONVEYOR_KV_FAULT"]
    dec = KVConnectorWorker(KVTransferConfig(role="decode", transfer_timeout_s=5.0), bs)
    dst = _caches(fill=False)
    pre.register_kv_caches(_caches())
    dec.register_kv_caches(dst)
    try:
        tid = "fault-delay-0.3-a"
        pre.wait_for_save(KVConnectorMeta(saves=[SaveSpec(tid, [0, 1], 8)]))
        dec.start_load_kv(KVConnectorMeta(loads=[LoadSpec(tid, "127.0.0.1", port, [2, 3], 8)]))
        dec.start_load_kv(KVConnectorMeta(cancels=[tid]))
        _wait_sent(pre, tid)  # the done notice follows the reply: the reply has arrived
        dec.start_load_kv(None)
        assert dec.get_finished() is None
        assert all(k.abs().sum() == 0 and v.abs().sum() == 0 for k, v in dst)
    finally:
        pre.shutdown()
        dec.shutdown()


# ---- two engines in one process ------------------------------------------------------------
def test_a_held_back_load_blocks_no_other_request():
    from conveyor.config import EngineArgs
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.sampling_params import SamplingParams

    from helpers import make_checkpoint

    common = dict(model=make_checkpoint("llama"), dtype="float32", num_threads=1,
                  block_size=8, num_kv_blocks=64, warmup=False)
    port = free_port()
    pre = LLMEngine(EngineArgs(**common, kv_role="prefill", kv_port=port))
    dec = LLMEngine(EngineArgs(**common, kv_role="decode", kv_transfer_timeout=120.0))
    # The prefill side answers the pull only once the other request has ended: the load is
    # held back for as long as that takes, on any machine.
    fast_ended = threading.Event()
    server = pre.core.executor.kv_worker.server
    serve_pull = server.on_pull

    def held_pull(req):
        assert fast_ended.wait(120), "the other request never ended"
        return serve_pull(req)

    server.on_pull = held_pull
    try:
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        prompt = list(range(10, 40))
        tid = f"held-{uuid.uuid4().hex}"
        pre.add_request(prompt, greedy, kv_transfer_params=KVTransferParams(
            tid, do_remote_decode=True))
        while pre.core.scheduler.requests:
            pre.step()
        slow = dec.add_request(prompt, greedy, kv_transfer_params=KVTransferParams(
            tid, do_remote_prefill=True, remote_host="127.0.0.1", remote_port=port,
            num_prompt_tokens=len(prompt)))
        fast = dec.add_request(list(range(50, 70)), greedy)
        finished: list[str] = []
        slow_state_when_fast_ended = None
        deadline = time.monotonic() + 300  # a failsafe: both end long before
        while len(finished) < 2 and time.monotonic() < deadline:
            finished += [o.request_id for o in dec.step() if o.finished]
            pre.core.step()
            dec.core.scheduler.check_invariants()
            if finished == [fast] and slow_state_when_fast_ended is None:
                slow_state_when_fast_ended = dec.core.scheduler.requests[slow].status
                fast_ended.set()
        # The other request ran to its end while this one's K/V was held back.
        assert slow_state_when_fast_ended is RequestStatus.WAITING_FOR_REMOTE_KV
        assert finished == [fast, slow]
        assert dec.core.stats()["kv_transfer"]["loads_ok"] == 1
    finally:
        fast_ended.set()  # a failed run must not leave the server's thread held
        pre.core.executor.shutdown()
        dec.core.executor.shutdown()
