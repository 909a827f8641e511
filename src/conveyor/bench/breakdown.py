"""Per-group figures of a run: latency by class or tenant, and service share over time.

A scheduling policy's claims are about groups of requests, not the whole run: the
urgent class keeps its latency, the light tenants keep theirs, each backlogged tenant
gets its share of the machine. These helpers cut a run's ``RequestRecord``s by a key
(``tenant``, ``priority``, or any function of a record).

Service is counted the way the ``fair`` policy counts it (Virtual Token Counter):
``input_weight`` per prompt token not served from the prefix cache, charged when the
request's first token comes out (its prefill ends in that step or shortly before), and
``output_weight`` per generated token, charged at the time the token came out. Token
times are rebuilt from the record: ``arrival + ttft``, then the inter-token gaps.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from conveyor.bench.metrics import LatencyStats, RequestRecord

GroupKey = Callable[[RequestRecord], Hashable]


def by_tenant(record: RequestRecord) -> str:
    return record.tenant


def by_priority(record: RequestRecord) -> int:
    return record.priority


def latency_by(records: Iterable[RequestRecord], group: GroupKey = by_tenant,
               metric: str = "ttft") -> dict[Hashable, LatencyStats]:
    """``metric`` (ttft, tpot, e2e, queue) of completed requests, per group, in ms."""
    samples: dict[Hashable, list[float]] = {}
    for r in records:
        if not r.ok:
            continue
        value = getattr(r, f"{metric}_s")
        if value is not None:
            samples.setdefault(group(r), []).append(value)
    return {key: LatencyStats.of(values) for key, values in samples.items()}


def token_times(record: RequestRecord) -> list[float]:
    """When each generated token came out, in seconds on the run's clock ([] if none)."""
    if not record.ok or record.ttft_s is None:
        return []
    t = record.arrival_s + record.ttft_s
    times = [t]
    for gap in record.itls_s:
        t += gap
        times.append(t)
    return times


@dataclass
class ServiceTimeline:
    """Service per group in consecutive time bins: ``service[g][i]`` covers
    ``[edges[i], edges[i + 1])``."""

    edges: list[float]
    service: dict[Hashable, list[float]]

    @property
    def centers(self) -> list[float]:
        return [(a + b) / 2 for a, b in zip(self.edges, self.edges[1:])]

    def shares(self) -> dict[Hashable, list[float]]:
        """Each group's fraction of the bin's service (NaN in a bin nobody was served)."""
        totals = [sum(col) for col in zip(*self.service.values())]
        return {g: [s / t if t > 0 else math.nan for s, t in zip(values, totals)]
                for g, values in self.service.items()}

    def share_between(self, start: float, end: float) -> dict[Hashable, float]:
        """Each group's fraction of all service in the bins that lie within [start, end]."""
        lo = bisect.bisect_left(self.edges, start)
        hi = bisect.bisect_right(self.edges, end) - 1  # bins lo .. hi-1 end by ``end``
        sums = {g: sum(values[lo:max(hi, lo)]) for g, values in self.service.items()}
        total = sum(sums.values())
        return {g: s / total if total > 0 else math.nan for g, s in sums.items()}


def service_timeline(records: Iterable[RequestRecord], bin_s: float, *,
                     group: GroupKey = by_tenant, input_weight: float = 1.0,
                     output_weight: float = 2.0, end_s: float | None = None
                     ) -> ServiceTimeline:
    """Weighted service per group in bins of ``bin_s`` seconds from t=0 to ``end_s``
    (default: the last token); every group with a record gets a row, served or not."""
    if not bin_s > 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    events: list[tuple[Hashable, float, float]] = []  # (group, time, amount)
    groups: list[Hashable] = []
    for r in records:
        key = group(r)
        if key not in groups:
            groups.append(key)
        times = token_times(r)
        if not times:
            continue
        uncached = max(r.prompt_tokens - r.num_cached_tokens, 0)
        events.append((key, times[0], input_weight * uncached))
        events.extend((key, t, output_weight) for t in times)
    if end_s is None:  # up to the bin that holds the last token
        num_bins = int(max((t for _, t, _ in events), default=0.0) // bin_s) + 1
    else:
        num_bins = max(1, math.ceil(end_s / bin_s))
    service = {g: [0.0] * num_bins for g in groups}
    for key, t, amount in events:
        i = int(t // bin_s)
        if 0 <= i < num_bins:
            service[key][i] += amount
    return ServiceTimeline([i * bin_s for i in range(num_bins + 1)], service)
