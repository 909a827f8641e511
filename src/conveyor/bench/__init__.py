"""Benchmark harness: replay workloads through a backend and report latency and throughput.

    workload (trace or synthetic) -> backend (in-process engine | OpenAI HTTP) -> records
    records -> summary (throughput, TTFT/TPOT/ITL/E2E percentiles, goodput) -> table/JSON/plots

Records are built from ``conveyor.outputs.RequestMetrics`` so that any producer of
those figures (the engine, an HTTP client, the simulator) gets the same report. A
simulator reuses the whole path:

    add_workload_args(parser)                      # the same workload options
    requests = load_workload(args, vocab_size)     # BenchRequest: arrival, prompt ids, ...
    records  = records_from_metrics(requests, {request_id: RequestMetrics}, t0)
    summary  = summarize(records, duration_s)      # -> report.format_summary / save_json
"""

from __future__ import annotations

from conveyor.bench.metrics import (
    RequestRecord,
    RunResult,
    Summary,
    records_from_metrics,
    summarize,
)
from conveyor.bench.workload import BenchRequest, WorkloadError, add_workload_args, load_workload

__all__ = ["BenchRequest", "RequestRecord", "RunResult", "Summary", "WorkloadError",
           "add_workload_args", "load_workload", "records_from_metrics", "summarize"]
