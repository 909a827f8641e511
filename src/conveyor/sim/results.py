"""A simulated run as the benchmark harness's ``RunResult``: the same records and summary.

The simulator fills ``RequestMetrics`` on its virtual clock, whose zero is the
workload's zero, so records come from ``RequestRecord.from_metrics`` with ``t0 = 0``
and the run lasts until its last step ends, as ``conveyor bench`` measures a real
run. Refused requests keep the engine's reason; requests the run never finished
(a stuck engine, or a capacity probe cut short) are recorded as failed.
"""

from __future__ import annotations

from collections.abc import Sequence

from conveyor.bench.metrics import RequestRecord, RunResult, summarize
from conveyor.bench.workload import BenchRequest
from conveyor.sim.simulator import SimResult, Simulator


def merge_budget_stats(per_replica: list[dict]) -> dict:
    """The replicas' token budget figures summed (modes and ceilings are alike)."""
    if not per_replica or per_replica[0].get("mode") != "slo":
        return dict(per_replica[0]) if per_replica else {}
    out = dict(per_replica[0])
    for key in ("num_steps", "num_time_bound", "num_ceiling_bound", "num_demand_bound",
                "num_over_limit", "num_lost_decodes", "num_admitted_extra",
                "num_refused_extra"):
        out[key] = sum(r[key] for r in per_replica)
    out["histogram"] = {b: sum(r["histogram"][b] for r in per_replica)
                        for b in per_replica[0]["histogram"]}
    out["histogram_sum"] = sum(r["histogram_sum"] for r in per_replica)
    steps = out["num_steps"]
    out["mean_predicted_step_s"] = (sum(r["mean_predicted_step_s"] * r["num_steps"]
                                        for r in per_replica) / steps if steps else 0.0)
    return out


def run_result(requests: Sequence[BenchRequest], result: SimResult, sim: Simulator,
               label: str = "sim") -> RunResult:
    records = []
    for req in requests:
        rid = req.request_id
        if rid in result.finished:
            records.append(RequestRecord.from_metrics(req, result.finished[rid], 0.0))
        elif rid in result.errors:
            records.append(RequestRecord.failed(req, result.errors[rid]))
        else:
            why = ("not run: the run stopped early" if result.stopped_early
                   else "unfinished: still queued when the simulated engines went idle")
            records.append(RequestRecord.failed(req, why))
    reps = result.replicas
    steps = sum(r.num_steps for r in reps)
    rows = sum(r.num_batched_rows for r in reps)
    args = sim.engine_args
    summary = summarize(
        records, result.sim_time,
        num_preemptions=sum(r.num_preemptions for r in reps),
        peak_kv_usage=max(r.peak_kv_blocks / max(r.num_kv_blocks, 1) for r in reps),
        extra={"backend": "sim", "num_steps": steps,
               "mean_batch_size": rows / steps if steps else 0.0,
               "num_kv_blocks": result.num_kv_blocks, "batching": args.batching,
               "max_num_seqs": args.max_num_seqs, "model": sim.config.model.served_model_name,
               "dtype": sim.config.model.dtype, "cost_model": result.cost_model,
               "replicas": sim.num_replicas, "router": sim.router_name,
               "sim_wall_s": result.wall_s, "sim_events": result.num_events,
               "sim_events_per_s": result.events_per_s,
               "num_slo_rejected": sum(r.num_slo_rejected for r in reps),
               "token_budget": merge_budget_stats([r.token_budget or {} for r in reps])})
    return RunResult(label, records, summary)
