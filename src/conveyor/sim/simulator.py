"""The simulator: replicas of the real scheduler on one virtual clock, fed by a workload.

One global event loop over virtual time. Events at the same instant are taken in
this order, which is what the real engine does between two steps:

    1. a step ends      (its update: tokens, finishes, freed blocks)
    2. requests arrive  (the router sees the loads after those finishes)
    3. a step starts    (schedule() sees every request that has arrived by now)

A request routed to a replica in the middle of a step joins that replica's scheduler
at its next step start, after the step's update, as the engine's loop adds requests
between steps (a policy's bookkeeping on arrival then sees the update's effects).

A replica with nothing to run sleeps until a request is routed to it; the clock
jumps from event to event, so an hour of traffic costs only the steps it contains.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from conveyor.config import EngineArgs, EngineConfig, ModelConfig, resolve_engine_config
from conveyor.costs.factory import load_step_cost
from conveyor.costs.protocol import MachineCostModel
from conveyor.engine.validation import capped_max_tokens
from conveyor.executor.cost_model import CostModelExecutor
from conveyor.outputs import RequestMetrics
from conveyor.sampling_params import SamplingParams
from conveyor.sim.model import resolve_sim_model
from conveyor.sim.replica import (
    SimReplica,
    StepListener,
    WorkloadRequest,
    default_params,
)
from conveyor.sim.router import make_router

_END, _ARRIVAL, _START = 0, 1, 2  # order of events at the same instant


@dataclass
class ReplicaStats:
    index: int
    num_requests: int
    num_steps: int
    num_batched_rows: int  # requests summed over steps (mean batch size = this / num_steps)
    busy_time: float  # virtual seconds spent in steps
    num_preemptions: int
    num_rejected: int
    peak_running: int
    peak_waiting: int
    num_kv_blocks: int
    peak_kv_blocks: int
    prefix_cache_hit_rate: float
    num_slo_rejected: int = 0
    token_budget: dict | None = None  # EngineCore.token_budget_stats()


@dataclass
class SimResult:
    # request id -> metrics, in the order requests finished
    finished: dict[str, RequestMetrics]
    # request id -> why the engine refused it: "invalid: ..." (validation) or
    # "rejected: ..." (full queue), as the benchmark harness records them
    errors: dict[str, str]
    unfinished: list[str]  # still queued when events ran out (a stuck engine)
    replica_of: dict[str, int]
    replicas: list[ReplicaStats]
    num_steps: int
    num_events: int  # arrivals plus steps
    sim_time: float  # virtual time of the last event
    wall_s: float
    num_kv_blocks: int  # per replica
    max_model_len: int
    cost_model: str
    stopped_early: bool = False

    @property
    def metrics(self) -> list[RequestMetrics]:
        return list(self.finished.values())

    @property
    def events_per_s(self) -> float:
        return self.num_events / self.wall_s if self.wall_s > 0 else float("inf")


class Simulator:
    """Simulates ``replicas`` engines built from ``engine_args``, timed by ``cost``.

    Engine options (policy, caps, block size, KV pool, prefix caching, batching mode)
    come from ``engine_args`` exactly as ``LLMEngine`` reads them; the KV pool, when
    ``engine_args`` does not size it, is what the cost model's machine would hold.
    """

    def __init__(self, engine_args: EngineArgs, cost: MachineCostModel, *, replicas: int = 1,
                 router: str = "round_robin",
                 make_params: Callable[[WorkloadRequest], SamplingParams] | None = None,
                 model: ModelConfig | None = None, lora_swap_s: float = 0.0) -> None:
        """``lora_swap_s``: with --enable-lora, seconds a step pays per adapter it swaps
        into one of the ``--max-loras`` slots (``executor/lora_slots.py``)."""
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        make_router(router)  # an unknown name fails here, before any run
        self.engine_args = engine_args
        self.cost = cost
        self.num_replicas = replicas
        self.lora_swap_s = lora_swap_s
        self.router_name = router
        model = model or resolve_sim_model(engine_args)
        # The engine's own derivation (config.resolve_engine_config): the pool the cost
        # model's machine holds caps the longest sequence.
        num_blocks = CostModelExecutor(cost, model).determine_num_kv_blocks(
            engine_args.cache_config(), model, engine_args.max_num_seqs)
        self.config: EngineConfig = resolve_engine_config(engine_args, model, num_blocks,
                                                          device="simulated")
        # The SLO token budget controller's step-cost model: the one named in the engine
        # args (as the engine loads it), else the simulator's own (exact predictions).
        self.step_cost = (load_step_cost(engine_args.slo_cost_model, self.config.model)
                          if engine_args.slo_cost_model
                          else cost if getattr(cost, "predictive", True) else None)
        eos = frozenset(self.config.model.eos_token_ids)
        self.make_params = make_params or (lambda item: default_params(item, eos))
        self.step_listeners: list[StepListener] = []

    @property
    def num_kv_blocks(self) -> int:
        return self.config.cache.num_kv_blocks or 0

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    def pool_blocks(self, items: list[WorkloadRequest]) -> int:
        """KV blocks each replica allocates: the configured pool, or fewer if ``items`` fit.

        A pool that can hold every request of the workload at once, each at its longest,
        never runs short: the scheduler's only question of it (are there enough free
        blocks?) is always yes, nothing is preempted or evicted, and a larger pool makes
        the very same decisions. Allocating only that much keeps a small model on a
        large GPU (millions of blocks of logical pool) cheap to simulate.
        """
        full = self.num_kv_blocks
        bs = self.config.cache.block_size
        max_len = self.max_model_len
        need = 0
        spec = self.config.scheduler.speculative
        # A draft model's lookahead slots (its proposals' K/V) come on top.
        lookahead = -(-spec.num_speculative_tokens // bs) if spec and spec.writes_draft_kv else 0
        for item in items:
            prompt = len(item.prompt_token_ids)
            if prompt > max_len:
                continue  # refused: never takes a block
            tokens = prompt + capped_max_tokens(self.make_params(item), prompt, max_len)
            need += -(-min(tokens, max_len) // bs) + 1 + lookahead
            if need >= full:
                return full
        return max(need, 1)

    def run(self, requests: Iterable[WorkloadRequest], *,
            on_finished: Callable[[str, RequestMetrics | None], bool] | None = None
            ) -> SimResult:
        """Simulate until every request is done.

        ``on_finished(request_id, metrics)`` is called as each request finishes (metrics
        None if the engine refused it); returning True stops the run there, with
        ``stopped_early`` set (a capacity search stops once its SLO target is lost).
        """
        t0 = time.perf_counter()
        items = sorted(requests, key=lambda r: r.arrival_s)
        _check_unique_ids(items)
        pool = self.pool_blocks(items)
        replicas = [SimReplica(i, self.config, self.cost, self.make_params, self.step_listeners,
                               pool_blocks=pool, step_cost=self.step_cost,
                               lora_swap_s=self.lora_swap_s)
                    for i in range(self.num_replicas)]
        router = make_router(self.router_name)
        finished: dict[str, RequestMetrics] = {}
        errors: dict[str, str] = {}
        replica_of: dict[str, int] = {}
        routed = [0] * len(replicas)
        heap: list[tuple[float, int, int, int]] = []
        seq = itertools.count()
        start_pending = [False] * len(replicas)
        num_steps = 0
        now = 0.0
        i, n = 0, len(items)
        stopped = False

        def start(r: int, now: float) -> bool:
            """Hand replica r its new requests, then schedule; True if the run must stop."""
            start_pending[r] = False
            replica = replicas[r]
            stop = False
            if replica.inbox:
                for rid, why in replica.take_inbox():
                    errors[rid] = why
                    del replica_of[rid]
                    routed[r] -= 1
                    stop = (on_finished is not None and on_finished(rid, None)) or stop
            end = replica.start_step(now)
            if end is not None:
                heapq.heappush(heap, (end, _END, next(seq), r))
            elif replica.scheduler.num_running:
                raise RuntimeError(f"replica {r} scheduled nothing at t={now:.6f}s with "
                                   f"{replica.scheduler.num_running} running requests")
            # else: idle (or waiting requests the pool cannot take) until a new arrival.
            return stop

        while (heap or i < n) and not stopped:
            # The next arrival goes first unless a step ends before it (or at the same time).
            if i < n and (not heap or items[i].arrival_s < heap[0][0]
                          or (items[i].arrival_s == heap[0][0] and heap[0][1] > _ARRIVAL)):
                item = items[i]
                i += 1
                now = item.arrival_s
                r = router.route(item.prompt_token_ids, replicas, item.request_id,
                                 getattr(item, "lora", None))
                replicas[r].inbox.append(item)
                replica_of[item.request_id] = r
                routed[r] += 1
                if replicas[r].in_flight is None and not start_pending[r]:
                    start_pending[r] = True
                    heapq.heappush(heap, (now, _START, next(seq), r))
                continue
            now, kind, _, r = heapq.heappop(heap)
            if kind == _START:
                stopped = start(r, now)
                continue
            num_steps += 1
            done = replicas[r].finish_step(now)
            finished.update(done)
            if on_finished is not None:
                stopped = any([on_finished(rid, m) for rid, m in done])
            if (i < n and items[i].arrival_s <= now) or (heap and heap[0][0] <= now):
                # Arrivals and other step ends at this instant go before the next start.
                start_pending[r] = True
                heapq.heappush(heap, (now, _START, next(seq), r))
            else:
                stopped = start(r, now) or stopped  # the common case: the next step at once
        return SimResult(
            finished=finished, errors=errors,
            unfinished=[rid for rep in replicas
                        for rid in [*rep.unfinished_ids(), *(w.request_id for w in rep.inbox)]],
            replica_of=replica_of, replicas=[_stats(rep, routed[rep.index]) for rep in replicas],
            num_steps=num_steps, num_events=i + num_steps, sim_time=now,
            wall_s=time.perf_counter() - t0, num_kv_blocks=self.num_kv_blocks,
            max_model_len=self.max_model_len, cost_model=self.cost.describe(),
            stopped_early=stopped)


def simulate(requests: Iterable[WorkloadRequest], engine_args: EngineArgs,
             cost: MachineCostModel, *, replicas: int = 1,
             router: str = "round_robin") -> SimResult:
    return Simulator(engine_args, cost, replicas=replicas, router=router).run(requests)


def _check_unique_ids(items: list[WorkloadRequest]) -> None:
    seen: set[str] = set()
    for item in items:
        if item.request_id in seen:
            raise ValueError(f"request id {item.request_id!r} appears twice in the workload")
        seen.add(item.request_id)


def _stats(rep: SimReplica, num_requests: int) -> ReplicaStats:
    s = rep.scheduler.stats
    return ReplicaStats(index=rep.index, num_requests=num_requests, num_steps=rep.num_steps,
                        num_batched_rows=s.num_batched_rows, busy_time=rep.busy_time,
                        num_preemptions=s.num_preemptions, num_rejected=s.num_rejected,
                        peak_running=s.peak_running, peak_waiting=s.peak_waiting,
                        num_kv_blocks=rep.num_kv_blocks, peak_kv_blocks=rep.kv.peak_used_blocks,
                        prefix_cache_hit_rate=rep.kv.stats.hit_rate,
                        num_slo_rejected=s.num_slo_rejected,
                        token_budget=rep.core.token_budget_stats())
