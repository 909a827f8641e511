"""Benchmark harness: replay workloads through a backend and report latency and throughput.

    workload (trace or synthetic) -> backend (in-process engine | OpenAI HTTP) -> records
    records -> summary (throughput, TTFT/TPOT/ITL/E2E percentiles, goodput) -> table/JSON/plots

Records are built from ``conveyor.outputs.RequestMetrics`` so that any producer of
those figures (the engine, an HTTP client, the simulator) gets the same report.
"""

from __future__ import annotations

from conveyor.bench.metrics import RequestRecord, Summary, summarize
from conveyor.bench.workload import BenchRequest, WorkloadError, add_workload_args, load_workload

__all__ = ["BenchRequest", "RequestRecord", "Summary", "WorkloadError", "add_workload_args",
           "load_workload", "summarize"]
