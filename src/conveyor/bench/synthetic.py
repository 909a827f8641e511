"""Synthetic workloads: length distributions, arrival processes and named presets.

Distributions are written ``kind:params``:

    fixed:128                              every request 128 tokens
    uniform:32-256                         integers, both ends included
    lognormal:median=1020,sigma=0.6,max=4096

Arrivals are Poisson at ``rate`` or, with ``burstiness`` != 1, gamma-distributed gaps
with shape ``burstiness`` and the same mean (below 1: burstier than Poisson).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from conveyor.bench.traces import TraceRow, WorkloadError


@dataclass(frozen=True)
class LengthDist:
    kind: str  # fixed | uniform | lognormal
    lo: int = 1
    hi: int = 1
    median: float = 1.0
    sigma: float = 0.0

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.lo
        if self.kind == "uniform":
            return rng.randint(self.lo, self.hi)
        value = self.median * math.exp(rng.gauss(0.0, self.sigma))
        return int(min(max(round(value), self.lo), self.hi))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.lo}"
        if self.kind == "uniform":
            return f"uniform:{self.lo}-{self.hi}"
        return f"lognormal:median={self.median:g},sigma={self.sigma:g},min={self.lo},max={self.hi}"


def parse_length_dist(text: str) -> LengthDist:
    """Parse ``fixed:N``, ``uniform:LO-HI`` or ``lognormal:median=M,sigma=S[,min=A][,max=B]``."""
    kind, _, params = text.strip().partition(":")
    try:
        if kind == "fixed":
            n = int(params)
            dist = LengthDist("fixed", n, n)
        elif kind == "uniform":
            lo, _, hi = params.partition("-")
            dist = LengthDist("uniform", int(lo), int(hi))
        elif kind == "lognormal":
            kv = dict(part.split("=", 1) for part in params.split(",") if part)
            unknown = set(kv) - {"median", "sigma", "min", "max"}
            if unknown:
                raise WorkloadError(f"unknown lognormal parameter(s) {sorted(unknown)}")
            dist = LengthDist("lognormal", int(kv.get("min", 1)), int(kv.get("max", 1 << 20)),
                              float(kv["median"]), float(kv["sigma"]))
        else:
            raise WorkloadError(f"unknown length distribution {kind!r} in {text!r}; valid: "
                                "fixed:N, uniform:LO-HI, lognormal:median=M,sigma=S[,min,max]")
    except (ValueError, KeyError) as e:
        if isinstance(e, WorkloadError):
            raise
        raise WorkloadError(f"bad length distribution {text!r}: expected fixed:N, "
                            "uniform:LO-HI or lognormal:median=M,sigma=S[,min=A][,max=B]"
                            ) from None
    if dist.lo < 1 or dist.hi < dist.lo or dist.sigma < 0 or dist.median <= 0:
        raise WorkloadError(f"bad length distribution {text!r}: lengths must be >= 1 with "
                            "min <= max, median > 0 and sigma >= 0")
    return dist


@dataclass(frozen=True)
class SyntheticSpec:
    name: str
    input_len: LengthDist
    output_len: LengthDist
    description: str = ""


# Fitted to the Azure 2023 conversation trace (prompt median 1,020, mean 1,155, p99 4,142;
# output median 129, mean 211, p99 601, max 1,000): a lognormal with the trace's median
# and a sigma that puts the p99 near the trace's, capped at the trace's extremes.
PRESETS: dict[str, SyntheticSpec] = {
    "conversation": SyntheticSpec(
        "conversation",
        parse_length_dist("lognormal:median=1020,sigma=0.6,min=2,max=14050"),
        parse_length_dist("lognormal:median=129,sigma=0.8,min=7,max=1000"),
        "lengths like the Azure 2023 conversation service"),
    "wide-output": SyntheticSpec(
        "wide-output",
        parse_length_dist("uniform:128-1024"),
        parse_length_dist("uniform:16-1024"),
        "output lengths spread wide (static batching waits for the longest)"),
}


def synthetic_rows(spec: SyntheticSpec, num_requests: int, rate: float, burstiness: float,
                   seed: int) -> list[TraceRow]:
    """``num_requests`` rows with lengths from ``spec`` and arrivals at ``rate`` req/s."""
    if num_requests < 1:
        raise WorkloadError(f"--num-requests must be >= 1, got {num_requests}")
    rng = random.Random(seed)
    lengths = [(spec.input_len.sample(rng), spec.output_len.sample(rng))
               for _ in range(num_requests)]
    arrivals = arrival_times(num_requests, rate, burstiness, random.Random(seed + 1))
    return [TraceRow(t, i, o) for t, (i, o) in zip(arrivals, lengths)]


def arrival_times(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """First arrival at 0, then gaps with mean 1/rate (all zero when rate is inf)."""
    if rate <= 0:
        raise WorkloadError(f"--request-rate must be > 0 (or inf), got {rate}")
    if burstiness <= 0:
        raise WorkloadError(f"--burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    times, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        times.append(t)
    return times
