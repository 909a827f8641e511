"""Tensor-parallel ranks as Ray actors (the ``ray`` backend), for more than one machine.

A placement group holds one bundle per rank (``{"CPU": 1}``, or a GPU each on CUDA),
packed onto as few nodes as fit; rank r's actor goes to bundle r. The actors run the
same ``TPWorker`` as the ``mp`` backend, rendezvous at rank 0's node address on a free
port, and take the same msgpack commands (``TPWorker.handle``): Ray only places them
and carries the bytes. A rank whose actor dies raises ``RayActorError`` on its call,
which ends the executor like a dead process does. Ray is an optional extra
(``pip install conveyor[ray]``); ``ray.init()`` joins ``RAY_ADDRESS`` or starts a local
instance if this process has not connected yet.
"""

from __future__ import annotations

import logging
import time

from conveyor.config import EngineArgs
from conveyor.executor.tp import START_TIMEOUT_S, TensorParallelExecutor
from conveyor.executor.tp_messages import (
    WorkerCommand,
    WorkerFailed,
    WorkerReply,
    encode,
    reply_decoder,
)

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0


class RankActor:
    """The Ray actor around one rank's ``TPWorker`` (built by ``start``, so that every
    rank can join the process group at once)."""

    def __init__(self) -> None:
        self.worker = None

    def address(self) -> tuple[str, int]:
        """This node's address and a port free on it (rank 0's: the rendezvous)."""
        import ray

        from conveyor.executor.tp_worker import free_port

        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def start(self, args: EngineArgs, rank: int, init_method: str) -> bytes:
        from conveyor.executor.tp_worker import TPWorker

        try:
            self.worker = TPWorker(args, rank, init_method)
        except Exception as e:
            return encode(WorkerFailed(rank, f"rank {rank} could not start: "
                                             f"{type(e).__name__}: {e}"))
        return encode(self.worker.ready())

    def handle(self, data: bytes) -> bytes:
        return self.worker.handle(data)

    def ping(self) -> bool:
        return True

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()


class RayExecutor(TensorParallelExecutor):
    def __init__(self, args: EngineArgs) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        super().__init__(args)
        self.ray = ray
        if not ray.is_initialized():
            ray.init()
        gpu = args.device == "cuda"
        bundle = {"CPU": 1, "GPU": 1} if gpu else {"CPU": 1}
        self.pg = placement_group([dict(bundle) for _ in range(self.world_size)],
                                  strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.pg)
            raise RuntimeError(f"Ray could not place {self.world_size} bundles of {bundle} "
                               f"(cluster resources: {ray.cluster_resources()})") from None
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0)(RankActor)
        self.actors = [actor_cls.options(
            name=None, scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=rank)).remote()
            for rank in range(self.world_size)]
        ip, port = ray.get(self.actors[0].address.remote(), timeout=START_TIMEOUT_S)
        init_method = f"tcp://{ip}:{port}"
        refs = [a.start.remote(args, rank, init_method) for rank, a in enumerate(self.actors)]
        self._ready(self._gather(refs, START_TIMEOUT_S, "start"))

    def _call(self, cmd: WorkerCommand, timeout_s: float, what: str) -> list[WorkerReply]:
        self._check_alive()
        data = encode(cmd)
        return self._gather([a.handle.remote(data) for a in self.actors], timeout_s, what)

    def _gather(self, refs: list, timeout_s: float, what: str) -> list[WorkerReply]:
        """Replies as they come: the first dead or failed rank ends the wait (the others
        may be blocked in a collective with it)."""
        ray = self.ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        replies: list[WorkerReply | None] = [None] * len(refs)
        pending = list(refs)
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(left, 0))
            if not ready:
                self._fail(f"rank(s) {sorted(rank_of[r] for r in pending)} did not answer "
                           f"{what} within {timeout_s:g} s")
            for ref in ready:
                rank = rank_of[ref]
                try:
                    reply = reply_decoder(ray.get(ref))
                except ray.exceptions.RayActorError as e:
                    self._fail(f"rank {rank} died during {what} (its Ray actor: "
                               f"{type(e).__name__})")
                if isinstance(reply, WorkerFailed):
                    self._fail(reply.message)
                replies[rank] = reply
        return replies  # type: ignore[return-value]

    def check_health(self) -> None:
        self._check_alive()
        refs = [a.ping.remote() for a in self.actors]
        for rank, ref in enumerate(refs):
            try:
                self.ray.get(ref, timeout=HEALTH_TIMEOUT_S)
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
                self._fail(f"rank {rank} died (its Ray actor does not answer)")

    def _stop_ranks(self, graceful: bool) -> None:
        ray = self.ray
        if self.pg is None:
            return  # stopped already
        if graceful:
            try:
                ray.get([a.stop.remote() for a in self.actors], timeout=10)
            except Exception:  # stopping anyway
                logger.warning("a rank did not stop cleanly", exc_info=True)
        for actor in self.actors:
            ray.kill(actor)
        ray.util.remove_placement_group(self.pg)
        self.actors, self.pg = [], None
