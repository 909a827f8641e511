"""Workloads: what requests arrive when, with which prompt tokens and output lengths.

``add_workload_args(parser)`` and ``load_workload(args, vocab_size)`` are the library
entry points shared by ``conveyor bench`` and ``conveyor sim``:

    rows   = trace file or synthetic preset                (arrival, input len, output len)
    rows   = sample --num-requests, rescale arrivals, scale and cap lengths
    reqs   = BenchRequest with prompt token ids, tenant, priority, SLO targets

Prompt tokens are random ids (a seeded stream per request, so no two requests share a
prefix by accident), except Mooncake's hash ids: each id is one block of deterministic
tokens, so requests that share leading ids share that prompt prefix.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
from dataclasses import dataclass, replace

import numpy as np

from conveyor.bench.synthetic import PRESETS, parse_length_dist, synthetic_rows
from conveyor.bench.traces import TraceRow, WorkloadError, parse_trace

__all__ = ["BenchRequest", "WorkloadError", "add_workload_args", "load_workload"]

# Prompt ids start here, clear of the special tokens that low ids usually hold.
FIRST_PROMPT_TOKEN = 16


@dataclass
class BenchRequest:
    """One request of a workload: the unit a backend (or the simulator) replays."""

    request_id: str
    arrival_s: float  # seconds after the start of the run
    prompt_token_ids: list[int]
    output_len: int  # tokens to generate (forced: EOS is ignored)
    tenant: str = "default"
    priority: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    lora: str | None = None  # the adapter it names (the simulator; None: the base model)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


# ---- options ------------------------------------------------------------------------------
def add_workload_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the workload options; ``--seed`` is shared with the engine's if already there."""
    g = parser.add_argument_group("workload")
    g.add_argument("--workload", default="conversation",
                   help="a trace file (Azure CSV or Mooncake JSONL) or a synthetic preset: "
                        f"{', '.join(PRESETS)} (default: conversation)")
    g.add_argument("--workload-format", default="auto", choices=("auto", "azure", "mooncake"),
                   help="trace format (auto: by extension, .csv azure, .jsonl mooncake)")
    g.add_argument("--num-requests", type=int, default=None,
                   help="requests to replay (default: the whole trace; 200 for a preset)")
    g.add_argument("--sample", default="head", choices=("head", "random", "families"),
                   help="which trace rows --num-requests takes: the first ones, a seeded "
                        "random sample across the whole trace, or (Mooncake) whole prefix "
                        "families, drawn at random, so that shared prefixes stay shared")
    g.add_argument("--request-rate", type=_parse_rate, default=None,
                   help="requests/s: rescales a trace's arrivals to this mean rate, or the "
                        "rate of a preset's arrivals; inf sends everything at t=0 "
                        "(default: the trace's own times; inf for a preset)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="preset arrivals: gamma shape of the gaps (1: Poisson, <1: burstier)")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply arrival times (0.1 replays ten times faster)")
    g.add_argument("--input-scale", type=float, default=1.0,
                   help="multiply prompt lengths (so an hour-long trace fits a CPU)")
    g.add_argument("--output-scale", type=float, default=1.0,
                   help="multiply output lengths")
    g.add_argument("--max-input-len", type=int, default=None,
                   help="truncate prompts to this many tokens")
    g.add_argument("--max-output-len", type=int, default=None,
                   help="cap output lengths at this many tokens")
    g.add_argument("--input-len", type=parse_length_dist, default=None,
                   help="preset override: prompt length distribution, e.g. uniform:32-256, "
                        "fixed:128, lognormal:median=1020,sigma=0.6,max=4096")
    g.add_argument("--output-len", type=parse_length_dist, default=None,
                   help="preset override: output length distribution")
    g.add_argument("--tenants", type=_parse_mix, default=None,
                   help="tenant mix, e.g. a=0.7,b=0.3 (each request draws a tenant)")
    g.add_argument("--priorities", type=_parse_priority_mix, default=None,
                   help="priority class mix, e.g. 0=0.8,1=0.2")
    g.add_argument("--slo-ttft", type=float, default=None,
                   help="TTFT target in ms: attached to each request and used for goodput")
    g.add_argument("--slo-tpot", type=float, default=None,
                   help="TPOT target in ms: attached to each request and used for goodput")
    if "--seed" not in parser._option_string_actions:
        g.add_argument("--seed", type=int, default=0, help="workload random seed")
    return parser


def load_workload(args: argparse.Namespace, vocab_size: int) -> list[BenchRequest]:
    """The requests the parsed options describe; prompt ids lie in [16, vocab_size)."""
    if vocab_size <= FIRST_PROMPT_TOKEN + 1:
        raise WorkloadError(f"vocab_size {vocab_size} is too small for prompt tokens")
    rows = workload_rows(args)
    return build_requests(rows, vocab_size, seed=args.seed, tenants=args.tenants,
                          priorities=args.priorities, slo_ttft_ms=args.slo_ttft,
                          slo_tpot_ms=args.slo_tpot)


def workload_rows(args: argparse.Namespace) -> list[TraceRow]:
    """Rows (no token ids yet) after sampling, arrival rescaling and length scaling."""
    _check_positive(args, "num_requests", "time_scale", "input_scale", "output_scale",
                    "max_input_len", "max_output_len")
    if args.workload in PRESETS and not os.path.exists(args.workload):
        spec = PRESETS[args.workload]
        spec = replace(spec, input_len=args.input_len or spec.input_len,
                       output_len=args.output_len or spec.output_len)
        rate = math.inf if args.request_rate is None else args.request_rate
        rows = synthetic_rows(spec, args.num_requests or 200, rate, args.burstiness, args.seed)
    else:
        if not os.path.isfile(args.workload):
            raise WorkloadError(f"--workload {args.workload!r} is neither a file nor a preset "
                                f"({', '.join(PRESETS)})")
        if args.input_len or args.output_len:
            raise WorkloadError("--input-len/--output-len apply to presets, not trace files")
        rows = parse_trace(args.workload, args.workload_format)
        rows = select_rows(rows, args.num_requests, args.sample, args.seed)
        if args.request_rate is not None:
            rows = rescale_to_rate(rows, args.request_rate)
    rows = scale_times(rows, args.time_scale)
    return scale_lengths(rows, args.input_scale, args.output_scale, args.max_input_len,
                         args.max_output_len)


# ---- transforms ---------------------------------------------------------------------------
def select_rows(rows: list[TraceRow], num: int | None, how: str, seed: int) -> list[TraceRow]:
    """The first ``num`` rows, a seeded random sample or whole prefix families (see
    ``sample_families``), in arrival order; starts at t=0."""
    if num is not None and num < len(rows):
        if how == "random":
            picked = sorted(random.Random(seed).sample(range(len(rows)), num))
            rows = [rows[i] for i in picked]
        elif how == "families":
            rows = sample_families(rows, num, seed)
        else:
            rows = rows[:num]
    start = rows[0].arrival_s if rows else 0.0
    return [replace(r, arrival_s=r.arrival_s - start) for r in rows]


def sample_families(rows: list[TraceRow], num: int, seed: int) -> list[TraceRow]:
    """``num`` rows made of whole prefix families, in arrival order.

    A family is every row with the same first hash id (rows can only share a prefix
    within one). Families are taken in a seeded random order, each only if it still
    fits, so a sample keeps the trace's reuse: a random sample of rows would split
    families and lose most of it (the trace's reuse spans its whole hour).
    """
    if not all(r.hash_ids for r in rows):
        raise WorkloadError("--sample families needs a trace with hash_ids (Mooncake)")
    families: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        families.setdefault(r.hash_ids[0], []).append(i)
    order = list(families.values())
    random.Random(seed).shuffle(order)
    picked: list[int] = []
    for members in order:
        if len(picked) + len(members) <= num:
            picked.extend(members)
        if len(picked) == num:
            break
    return [rows[i] for i in sorted(picked)]


def rescale_to_rate(rows: list[TraceRow], rate: float) -> list[TraceRow]:
    """Stretch arrivals so the mean rate over the span is ``rate`` (shape kept); inf: t=0."""
    if rate <= 0:
        raise WorkloadError(f"--request-rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [replace(r, arrival_s=0.0) for r in rows]
    if len(rows) < 2:
        return list(rows)
    start = rows[0].arrival_s
    span = rows[-1].arrival_s - start
    factor = (len(rows) - 1) / rate / span if span > 0 else math.inf
    if not math.isfinite(factor):
        return list(rows)  # all at one instant (or too close to tell): no rate to rescale
    return [replace(r, arrival_s=(r.arrival_s - start) * factor) for r in rows]


def scale_times(rows: list[TraceRow], factor: float) -> list[TraceRow]:
    if factor == 1.0:
        return rows
    return [replace(r, arrival_s=r.arrival_s * factor) for r in rows]


def scale_lengths(rows: list[TraceRow], input_scale: float, output_scale: float,
                  max_input: int | None, max_output: int | None) -> list[TraceRow]:
    """Multiply token counts (rounded, at least 1) and cap them.

    Mooncake blocks shrink with the prompt, so requests keep sharing the same
    fraction of their prompts.
    """
    out = []
    for r in rows:
        input_len = max(1, round(r.input_len * input_scale))
        output_len = max(1, round(r.output_len * output_scale))
        if max_input is not None:
            input_len = min(input_len, max_input)
        if max_output is not None:
            output_len = min(output_len, max_output)
        block = max(1, round(r.block_tokens * input_scale))
        out.append(replace(r, input_len=input_len, output_len=output_len, block_tokens=block))
    return out


# ---- prompts and labels -------------------------------------------------------------------
def build_requests(rows: list[TraceRow], vocab_size: int, *, seed: int = 0,
                   tenants: dict[str, float] | None = None,
                   priorities: dict[int, float] | None = None,
                   slo_ttft_ms: float | None = None,
                   slo_tpot_ms: float | None = None) -> list[BenchRequest]:
    prompts = PromptFactory(vocab_size, seed)
    label_rng = random.Random(seed + 2)
    tenant_of = _drawer(tenants, label_rng, "default")
    priority_of = _drawer(priorities, label_rng, 0)
    reqs = []
    for i, row in enumerate(rows):
        ids = (prompts.from_blocks(row.hash_ids, row.input_len, row.block_tokens, i)
               if row.hash_ids else prompts.random(row.input_len, i))
        reqs.append(BenchRequest(str(i), row.arrival_s, ids, row.output_len,
                                 tenant=tenant_of(), priority=priority_of(),
                                 slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms))
    return reqs


class PromptFactory:
    """Deterministic prompt token ids in [FIRST_PROMPT_TOKEN, vocab_size)."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.seed = seed
        self._blocks: dict[tuple[int, int], np.ndarray] = {}

    def block(self, hash_id: int, block_tokens: int) -> np.ndarray:
        """The tokens of one prefix block: a function of (seed, hash id, block size) only."""
        key = (hash_id, block_tokens)
        if key not in self._blocks:
            rng = np.random.default_rng([self.seed, 1, hash_id])
            self._blocks[key] = rng.integers(FIRST_PROMPT_TOKEN, self.vocab_size,
                                             block_tokens, dtype=np.int64)
        return self._blocks[key]

    def from_blocks(self, hash_ids: tuple[int, ...], length: int, block_tokens: int,
                    index: int) -> list[int]:
        """Concatenated blocks cut to ``length``; a shortfall is padded with request-own ids."""
        need = -(-length // block_tokens)
        parts = [self.block(h, block_tokens) for h in hash_ids[:need]]
        have = sum(len(p) for p in parts)
        if have < length:
            parts.append(np.asarray(self.random(length - have, index), dtype=np.int64))
        return np.concatenate(parts)[:length].tolist()

    def random(self, length: int, index: int) -> list[int]:
        rng = np.random.default_rng([self.seed, 2, index])
        return rng.integers(FIRST_PROMPT_TOKEN, self.vocab_size, length,
                            dtype=np.int64).tolist()


def _drawer(mix: dict | None, rng: random.Random, default):
    if not mix:
        return lambda: default
    names, weights = list(mix), list(mix.values())
    return lambda: rng.choices(names, weights)[0]


# ---- parsing helpers ----------------------------------------------------------------------
def _parse_rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 or inf, got {text}")
    return value


def _parse_mix(text: str) -> dict[str, float]:
    """``a=0.7,b=0.3`` (weights, normalized) or ``a,b`` (equal shares)."""
    mix: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, weight = part.partition("=")
        try:
            value = float(weight) if eq else 1.0
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad weight in {part!r}") from None
        if value < 0 or not name:
            raise argparse.ArgumentTypeError(f"bad mix entry {part!r}: NAME=WEIGHT, "
                                             "weight >= 0")
        mix[name] = value
    if not mix or sum(mix.values()) <= 0:
        raise argparse.ArgumentTypeError(f"mix {text!r} has no positive weight")
    return mix


def _parse_priority_mix(text: str) -> dict[int, float]:
    mix = _parse_mix(text)
    try:
        return {int(k): v for k, v in mix.items()}
    except ValueError:
        raise argparse.ArgumentTypeError(f"priority classes must be integers: {text!r}") \
            from None


def _check_positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise WorkloadError(f"--{name.replace('_', '-')} must be > 0, got {value}")


def describe(requests: list[BenchRequest]) -> str:
    """One line: count, prompt and output length stats, arrival span."""
    if not requests:
        return "0 requests"
    p = [r.prompt_len for r in requests]
    o = [r.output_len for r in requests]
    span = max(r.arrival_s for r in requests)
    return (f"{len(requests)} requests; prompt tokens mean {statistics.fmean(p):.0f} "
            f"median {statistics.median(p):.0f} max {max(p)}; output tokens mean "
            f"{statistics.fmean(o):.0f} median {statistics.median(o):.0f} max {max(o)} "
            f"(total {sum(o)}); arrivals over {span:.1f}s")
