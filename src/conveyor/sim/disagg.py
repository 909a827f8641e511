"""Prefill/decode disaggregation in the simulator: ``num_prefill`` prefill replicas and
``num_decode`` decode replicas of the real scheduler on one virtual clock.

    arrival -> a prefill replica (fewest unfinished)   the prompt, max_tokens 1
            -> its K/V crosses the link:               latency + bytes / bandwidth
               bytes = 2 x layers x prompt x kv heads x head dim x dtype bytes
            -> a decode replica (fewest unfinished)    --kv-role decode: the request waits
               in WAITING_FOR_REMOTE_KV, its load is reported done at once (the transfer
               time is in its arrival), it computes its last prompt token and decodes

Per-request metrics are the client's: TTFT from the request's arrival at the prefill to
its first token on the decode replica (as through ``conveyor router --prefill/--decode``,
whose client sees the decode engine's tokens). Simplifications, stated: transfers never
contend (each has the link to itself), a prefill replica frees the blocks at once (its
lease lasts the transfer, microseconds to milliseconds at GPU link speeds), and the
decode replica allocates the blocks when the bytes have landed, not before.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from conveyor.config import EngineArgs, ModelConfig, resolve_engine_config
from conveyor.core.kv_connector import KVWorkerReport
from conveyor.core.scheduler_output import ModelRunnerOutput
from conveyor.costs.protocol import MachineCostModel
from conveyor.engine.messages import EngineCoreRequest
from conveyor.executor.cost_model import CostModelExecutor
from conveyor.kv_transfer.messages import KVTransferParams
from conveyor.outputs import RequestMetrics
from conveyor.sampling_params import SamplingParams
from conveyor.sim.model import resolve_sim_model
from conveyor.sim.replica import SimReplica, WorkloadRequest, default_params

_END, _ARRIVAL, _START = 0, 1, 2  # order of events at the same instant (as simulator.py)
# 400 Gb/s per GPU (one RDMA NIC per H100, as in the Mooncake and DistServe set-ups).
DEFAULT_LINK_BYTES_PER_S = 50e9
DEFAULT_LINK_LATENCY_S = 20e-6


@dataclass
class DisaggResult:
    finished: dict[str, RequestMetrics]  # the client's view, in finishing order
    errors: dict[str, str]
    unfinished: list[str]
    num_prefill: int
    num_decode: int
    transfer_bytes: int
    transfer_s: float  # summed over requests
    sim_time: float
    wall_s: float
    busy: dict[str, list[float]] = field(default_factory=dict)  # virtual busy seconds
    # Prompt positions the decode replicas computed (one per request whose K/V arrived).
    decode_prompt_tokens_computed: int = 0


class _DecodeReplica(SimReplica):
    """A ``--kv-role decode`` replica: requests come with a prefill's handle."""

    def add(self, item: WorkloadRequest) -> None:
        params = self.make_params(item)
        kv = KVTransferParams(item.request_id, do_remote_prefill=True, remote_host="sim",
                              remote_port=0, num_prompt_tokens=len(item.prompt_token_ids))
        req = EngineCoreRequest(item.request_id, item.prompt_token_ids, params, item.arrival_s,
                                item.priority, item.tenant or "default", item.slo_ttft_ms,
                                item.slo_tpot_ms, kv)
        self.core.add_request(req)
        self._live[req.request_id] = RequestMetrics.for_core_request(req, *self._slo_defaults)

    def start_step(self, now: float) -> float | None:
        self.clock.now = now
        out = self.core.schedule()
        report = _landed(out)
        if out.is_empty:
            self._record(self.core.update(out, ModelRunnerOutput(kv_report=report)), now)
            if report is None:
                return None
            out = self.core.schedule()  # the requests whose K/V landed run now
            if out.is_empty:
                self._record(self.core.update(out, ModelRunnerOutput()), now)
                return None
            report = _landed(out)
        run = self.executor.execute_model(out)
        run.kv_report = report
        self.in_flight = (out, run)
        self.step_start = now
        return now + self.executor.last_step_s


def _landed(out) -> KVWorkerReport | None:
    meta = out.kv_connector_meta
    if meta is None or not meta.loads:
        return None
    return KVWorkerReport(recv_done=[load.transfer_id for load in meta.loads])


class DisaggSimulator:
    def __init__(self, engine_args: EngineArgs, cost: MachineCostModel, *, num_prefill: int,
                 num_decode: int, link_bytes_per_s: float = DEFAULT_LINK_BYTES_PER_S,
                 link_latency_s: float = DEFAULT_LINK_LATENCY_S,
                 model: ModelConfig | None = None) -> None:
        if num_prefill < 1 or num_decode < 1:
            raise ValueError("a disaggregated fleet needs >= 1 prefill and >= 1 decode replica")
        self.cost = cost
        self.num_prefill, self.num_decode = num_prefill, num_decode
        self.link_bytes_per_s, self.link_latency_s = link_bytes_per_s, link_latency_s
        model = model or resolve_sim_model(engine_args)
        num_blocks = CostModelExecutor(cost, model).determine_num_kv_blocks(
            engine_args.cache_config(), model, engine_args.max_num_seqs)
        self.prefill_config = resolve_engine_config(engine_args, model, num_blocks, "simulated")
        self.decode_config = resolve_engine_config(
            dataclasses.replace(engine_args, kv_role="decode"), model, num_blocks, "simulated")
        self.model = self.prefill_config.model
        self.step_cost = cost if getattr(cost, "predictive", True) else None

    def transfer_s(self, prompt_len: int) -> float:
        return self.link_latency_s + self.model.kv_bytes_per_token * prompt_len \
            / self.link_bytes_per_s

    def run(self, requests: Iterable[WorkloadRequest]) -> DisaggResult:
        t0 = time.perf_counter()
        items = sorted(requests, key=lambda r: r.arrival_s)
        eos = frozenset(self.model.eos_token_ids)
        by_id = {it.request_id: it for it in items}

        def prefill_params(item: WorkloadRequest) -> SamplingParams:
            return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                  eos_token_ids=eos)

        pools = {
            "P": [SimReplica(i, self.prefill_config, self.cost, prefill_params, [],
                             step_cost=self.step_cost) for i in range(self.num_prefill)],
            "D": [_DecodeReplica(i, self.decode_config, self.cost,
                                 lambda it: default_params(it, eos), [],
                                 step_cost=self.step_cost) for i in range(self.num_decode)],
        }
        heap: list = []
        seq = itertools.count()
        for it in items:
            heapq.heappush(heap, (it.arrival_s, _ARRIVAL, next(seq), ("P", it)))
        pending = {(k, i): False for k, reps in pools.items() for i in range(len(reps))}
        finished: dict[str, RequestMetrics] = {}
        errors: dict[str, str] = {}
        moved = 0
        moved_s = 0.0
        now = 0.0

        def start(key: tuple[str, int], now: float) -> None:
            pending[key] = False
            rep = pools[key[0]][key[1]]
            for rid, why in rep.take_inbox():
                errors[rid] = why
            end = rep.start_step(now)
            if end is not None:
                heapq.heappush(heap, (end, _END, next(seq), key))

        def wake(key: tuple[str, int], now: float) -> None:
            rep = pools[key[0]][key[1]]
            if rep.in_flight is None and not pending[key]:
                pending[key] = True
                heapq.heappush(heap, (now, _START, next(seq), key))

        while heap:
            now, kind, _, what = heapq.heappop(heap)
            if kind == _ARRIVAL:
                pool, item = what
                reps = pools[pool]
                r = min(range(len(reps)), key=lambda i: reps[i].num_unfinished)
                reps[r].inbox.append(item)
                wake((pool, r), now)
            elif kind == _START:
                start(what, now)
            else:
                rep = pools[what[0]][what[1]]
                done = rep.finish_step(now)
                if what[0] == "P":
                    for rid, m in done:
                        if m.finish_reason not in ("stop", "length"):
                            errors[rid] = f"prefill: {m.finish_reason}"
                            continue
                        item = by_id[rid]
                        dt = self.transfer_s(len(item.prompt_token_ids))
                        moved += self.model.kv_bytes_per_token * len(item.prompt_token_ids)
                        moved_s += dt
                        heapq.heappush(heap, (now + dt, _ARRIVAL, next(seq), ("D", item)))
                else:
                    finished.update(done)
                wake(what, now)
        unfinished = [rid for reps in pools.values() for rep in reps
                      for rid in [*rep.unfinished_ids(), *(w.request_id for w in rep.inbox)]]
        return DisaggResult(finished, errors, unfinished, self.num_prefill, self.num_decode,
                            moved, moved_s, now, time.perf_counter() - t0,
                            {k: [r.busy_time for r in reps] for k, reps in pools.items()},
                            sum(r.scheduler.stats.num_prompt_tokens_computed
                                for r in pools["D"]))


def slo_goodput(finished: dict[str, RequestMetrics], num_requests: int, ttft_s: float,
                tpot_s: float, span_s: float) -> tuple[float, float]:
    """(attainment, goodput in req/s): requests that finished normally within both."""
    from conveyor.sim.capacity import SLO

    slo = SLO(ttft_s, tpot_s)
    met = sum(1 for m in finished.values() if slo.met_by(m))
    return (met / num_requests if num_requests else 1.0,
            met / span_s if span_s > 0 else 0.0)


def arrival_span(items: Sequence[WorkloadRequest]) -> float:
    times = [it.arrival_s for it in items]
    return max(times) - min(times) if times else 0.0
