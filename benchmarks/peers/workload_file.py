"""The workload file every system replays, and the exact requests it expands to.

The file is a Mooncake-format JSONL (``timestamp`` ms, ``input_length``,
``output_length``, no ``hash_ids``) that ``conveyor bench --workload FILE --seed S``
reads: lengths come from conveyor's synthetic generator (uniform prompt and output
lengths, seeded), every timestamp is 0, and bench turns each row into random prompt
token ids from the same seed. ``load_requests`` runs that very expansion, so the
in-process adapter (HF generate) gets the token ids the servers get.

The default (seed 1234, 32 requests, prompts uniform 32-256, outputs uniform 16-256)
asks for 4,138 output tokens: the workload of the reference table in the benchmark issue.

``TraceSpec`` is the other workload the performance issue names: a sample of the Azure
conversation trace, token counts scaled down for a CPU and arrivals compressed to a
request rate, with its arrival times kept in the file (bench replays them as they are).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace

from conveyor.bench.synthetic import PRESETS, SyntheticSpec, parse_length_dist, synthetic_rows
from conveyor.bench.traces import TraceRow
from conveyor.bench.workload import BenchRequest


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 32
    prompt_len: str = "32-256"  # uniform, both ends included
    output_len: str = "16-256"
    seed: int = 1234

    def synthetic(self) -> SyntheticSpec:
        return replace(PRESETS["conversation"], name="peers",
                       input_len=parse_length_dist(f"uniform:{self.prompt_len}"),
                       output_len=parse_length_dist(f"uniform:{self.output_len}"))

    def describe(self) -> str:
        return (f"{self.num_requests} requests at t=0, prompts uniform {self.prompt_len}, "
                f"outputs uniform {self.output_len} (forced), seed {self.seed}")


@dataclass(frozen=True)
class TraceSpec:
    """A trace sample: the first ``num_requests`` rows, token counts times ``scale`` (prompts
    capped at ``max_input_len``), arrivals stretched to ``request_rate`` requests/s."""

    trace: str
    num_requests: int = 64
    scale: float = 0.25
    max_input_len: int = 1024
    request_rate: float = 4.0
    seed: int = 1234

    def describe(self) -> str:
        return (f"first {self.num_requests} requests of {os.path.basename(self.trace)}, "
                f"token counts x{self.scale:g} (prompts <= {self.max_input_len}), "
                f"arrivals at {self.request_rate:g} req/s (forced outputs), seed {self.seed}")


def workload_rows(spec: WorkloadSpec | TraceSpec) -> list[TraceRow]:
    if isinstance(spec, TraceSpec):
        from conveyor.bench.traces import parse_trace
        from conveyor.bench.workload import rescale_to_rate, scale_lengths, select_rows

        rows = select_rows(parse_trace(spec.trace), spec.num_requests, "first", spec.seed)
        rows = rescale_to_rate(rows, spec.request_rate)
        return scale_lengths(rows, spec.scale, spec.scale, spec.max_input_len, None)
    return synthetic_rows(spec.synthetic(), spec.num_requests, math.inf, 1.0, spec.seed)


def write_workload(path: str, spec: WorkloadSpec | TraceSpec) -> list[TraceRow]:
    """Write the JSONL file for ``spec``; returns its rows."""
    rows = workload_rows(spec)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps({"timestamp": round(row.arrival_s * 1000.0, 3),
                                "input_length": row.input_len,
                                "output_length": row.output_len}) + "\n")
    return rows


def bench_workload_argv(path: str, seed: int, at_once: bool = True) -> list[str]:
    """The `conveyor bench` options that replay the file: all requests at t=0, or (not
    ``at_once``) at the file's own arrival times."""
    argv = ["--workload", path, "--workload-format", "mooncake", "--seed", str(seed)]
    return argv + ["--request-rate", "inf"] if at_once else argv


def load_requests(path: str, seed: int, vocab_size: int,
                  at_once: bool = True) -> list[BenchRequest]:
    """Exactly the requests `conveyor bench` builds from the file (same code path)."""
    from conveyor.bench.cli import parse_bench_args
    from conveyor.bench.workload import load_workload

    args = parse_bench_args(bench_workload_argv(path, seed, at_once))
    return load_workload(args, vocab_size)


def write_requests_json(path: str, requests: list[BenchRequest]) -> None:
    """The token-id requests for an in-process adapter."""
    with open(path, "w") as f:
        json.dump([{"request_id": r.request_id, "prompt_token_ids": r.prompt_token_ids,
                    "output_len": r.output_len} for r in requests], f)
