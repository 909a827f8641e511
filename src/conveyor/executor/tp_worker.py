"""One tensor-parallel rank: its shard of the model, its KV pool, its process group.

``TPWorker`` is the same for every placement: ``executor/multiproc.py`` runs it in a
spawned process behind a pipe (``worker_main``), ``executor/ray_executor.py`` in a Ray
actor. Either way it takes ``tp_messages`` commands as msgpack bytes and answers each;
Ray and multiprocessing only place it and carry the bytes.

Every rank runs every step on the broadcast ``SchedulerOutput``: its runner keeps the
same persistent batch, computes its heads, joins the all-reduces, all-gathers the
logits and samples from them. The logits are bitwise equal on all ranks and the
samplers seeded alike, so every rank appends the same tokens; rank 0's output is the
one returned.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import signal
import socket
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from conveyor.config import CacheConfig, EngineArgs, EngineConfig, kv_blocks_for
from conveyor.config.kv_window import kv_groups
from conveyor.distributed.parallel import TPShard
from conveyor.executor.device import resolve_device
from conveyor.executor.tp_messages import (
    ExecuteModel,
    InitializeWorker,
    KVCacheSized,
    ModelExecuted,
    ShutdownWorker,
    SizeKVCache,
    WorkerFailed,
    WorkerInitialized,
    WorkerReady,
    WorkerReply,
    command_decoder,
    encode,
)
from conveyor.model.dtypes import resolve_compute_dtype
from conveyor.runner.model_runner import ModelRunner, default_kv_cache_memory

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the rendezvous of rank 0's store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_threads(args: EngineArgs) -> int:
    """Intra-op threads per rank on CPU: the cores (or ``num_threads``) split evenly."""
    total = args.num_threads or os.cpu_count() or 1
    return max(1, total // args.tensor_parallel_size)


class TPWorker:
    def __init__(self, args: EngineArgs, rank: int, init_method: str) -> None:
        world = args.tensor_parallel_size
        self.rank = rank
        device = resolve_device(args.device)
        if device.type == "cuda":
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(rank_threads(args))
        self.device = device
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", init_method=init_method,
            rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=args.distributed_timeout_s))
        model = args.resolve_model()
        self.model_config = dataclasses.replace(
            model, compute_dtype=resolve_compute_dtype(args.compute_dtype, model.dtype, device))
        self.tp = TPShard(rank, world, dist.group.WORLD)
        self.runner = ModelRunner(self.model_config, args.cache_config(), device,
                                  args.attention_backend, args.linear_backend,
                                  linear_rows=(args.max_num_seqs, args.max_num_batched_tokens),
                                  speculative=args.speculative, tp=self.tp,
                                  lora=args.lora_config())
        self.warmup = args.warmup

    def ready(self) -> WorkerReady:
        return WorkerReady(self.rank, self.model_config, str(self.device))

    def size_kv_cache(self, cache: CacheConfig, max_num_seqs: int) -> int:
        """Blocks this rank's memory holds: a block here is its KV heads only."""
        local = dataclasses.replace(self.model_config,
                                    num_kv_heads=self.runner.heads.num_kv_heads)
        return kv_blocks_for(cache, local, max_num_seqs,
                             default_memory=lambda: default_kv_cache_memory(self.device),
                             cap_to_useful=self.device.type != "cuda")

    def initialize(self, config: EngineConfig) -> WorkerInitialized:
        runner = self.runner
        runner.allocate_kv_cache(config.cache.num_kv_blocks, groups=kv_groups(config))
        if self.warmup:  # every rank runs it: its collectives pair with the others'
            runner.warmup(config.scheduler.max_num_batched_tokens,
                          config.model.max_model_len - 1)
        h = runner.heads
        return WorkerInitialized(self.rank, list(runner.kv_caches[0][0].shape),
                                 list(range(h.kv_start, h.kv_start + h.num_kv_heads)),
                                 list(range(h.q_start, h.q_start + h.num_heads)))

    def handle(self, data: bytes) -> bytes:
        """One command's reply, msgpack in and out (the Ray actor's entry point)."""
        return encode(self.reply(command_decoder(data)))

    def reply(self, cmd) -> WorkerReply:
        """A failure is answered as ``WorkerFailed``: the executor then stops every rank."""
        try:
            return self._dispatch(cmd)
        except Exception as e:
            logger.exception("rank %d failed", self.rank)
            return WorkerFailed(self.rank, f"rank {self.rank}: {type(e).__name__}: {e}")

    def _dispatch(self, cmd) -> WorkerReply:
        if isinstance(cmd, ExecuteModel):
            out = self.runner.execute(cmd.scheduler_output)
            return ModelExecuted(out if self.rank == 0 else None, out.lora_loaded,
                                 out.lora_failed)
        if isinstance(cmd, SizeKVCache):
            return KVCacheSized(self.size_kv_cache(cmd.cache, cmd.max_num_seqs))
        if isinstance(cmd, InitializeWorker):
            return self.initialize(cmd.config)
        raise ValueError(f"unexpected command {cmd!r}")

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def worker_main(args: EngineArgs, rank: int, init_method: str, conn: Connection) -> None:
    """A rank's process: build the worker, then answer commands until told to stop or
    the executor's end of the pipe closes (the executor is gone: never outlive it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the executor decides when to stop
    logging.basicConfig(level=logging.WARNING,
                        format=f"%(asctime)s %(levelname)s %(name)s (rank {rank}): %(message)s")
    try:
        worker = TPWorker(args, rank, init_method)
    except BaseException as e:
        conn.send_bytes(encode(WorkerFailed(rank, f"rank {rank} could not start: "
                                                  f"{type(e).__name__}: {e}")))
        return
    conn.send_bytes(encode(worker.ready()))
    try:
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                return
            cmd = command_decoder(data)
            if isinstance(cmd, ShutdownWorker):
                return
            conn.send_bytes(encode(worker.reply(cmd)))
    finally:
        worker.shutdown()
