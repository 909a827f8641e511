"""Per-group breakdowns (latency by class, service share over time) on hand-made records."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.bench.breakdown import (
    by_priority,
    latency_by,
    service_timeline,
    token_times,
)
from conveyor.bench.metrics import RequestRecord


def record(rid: str, tenant: str, arrival: float, ttft: float, itls: list[float],
           prompt: int = 10, cached: int = 0, priority: int = 0) -> RequestRecord:
    return RequestRecord(rid, arrival, tenant, priority, prompt, len(itls) + 1, len(itls) + 1,
                         ttft_s=ttft, e2e_s=ttft + sum(itls), itls_s=list(itls),
                         num_cached_tokens=cached, finish_reason="length")


def test_token_times_rebuilt_from_ttft_and_gaps():
    r = record("a", "x", arrival=1.0, ttft=0.5, itls=[0.25, 0.25, 1.0])
    assert token_times(r) == [1.5, 1.75, 2.0, 3.0]
    failed = RequestRecord("b", 0.0, "x", 0, 5, 0, 3, error="rejected")
    assert token_times(failed) == []


def test_service_timeline_hand_computed():
    # Tenant a: prompt 10 (2 cached) at t=0.5, tokens at 0.5, 1.5, 2.5.
    # Tenant b: prompt 4 at t=1.2, tokens at 1.2, 1.4.
    recs = [record("a", "a", 0.0, 0.5, [1.0, 1.0], prompt=10, cached=2),
            record("b", "b", 1.0, 0.2, [0.2], prompt=4)]
    tl = service_timeline(recs, bin_s=1.0, input_weight=1.0, output_weight=2.0)
    assert tl.edges == [0.0, 1.0, 2.0, 3.0]
    assert tl.service == {"a": [8 + 2, 2, 2], "b": [0, 4 + 2 + 2, 0]}
    shares = tl.shares()
    assert shares["a"] == pytest.approx([1.0, 0.2, 1.0])
    assert shares["b"] == pytest.approx([0.0, 0.8, 0.0])
    # Over the first two bins: a 12, b 8.
    assert tl.share_between(0.0, 2.0) == pytest.approx({"a": 0.6, "b": 0.4})
    # A window narrower than one bin holds no whole bin: no share to report.
    assert all(math.isnan(v) for v in tl.share_between(0.2, 0.8).values())


def test_service_timeline_weights_and_end_and_unserved_groups():
    recs = [record("a", "a", 0.0, 0.5, [1.0], prompt=3),
            RequestRecord("z", 0.0, "c", 0, 5, 0, 3, error="rejected")]
    tl = service_timeline(recs, bin_s=0.5, input_weight=0.0, output_weight=1.0, end_s=1.0)
    # Tokens at 0.5 and 1.5; the second lies past end_s and is not counted.
    assert tl.edges == [0.0, 0.5, 1.0]
    assert tl.service == {"a": [0, 1], "c": [0, 0]}
    assert math.isnan(tl.shares()["a"][0]) and tl.shares()["c"][1] == 0.0
    with pytest.raises(ValueError, match="bin_s"):
        service_timeline(recs, bin_s=0.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.floats(0, 5), st.floats(0, 1),
                          st.lists(st.floats(0, 0.5), max_size=6), st.integers(1, 50)),
                min_size=1, max_size=12),
       st.floats(0.05, 2.0))
def test_service_is_conserved_and_shares_sum_to_one(specs, bin_s):
    recs = [record(str(i), t, arr, ttft, itls, prompt=p)
            for i, (t, arr, ttft, itls, p) in enumerate(specs)]
    tl = service_timeline(recs, bin_s)
    expected = sum(r.prompt_tokens + 2 * r.output_tokens for r in recs)
    assert sum(map(sum, tl.service.values())) == pytest.approx(expected)
    for col in zip(*tl.shares().values()):
        if not any(math.isnan(v) for v in col):
            assert sum(col) == pytest.approx(1.0)


def test_latency_by_groups_completed_requests_only():
    recs = [record("a", "x", 0.0, 0.1, [], priority=0),
            record("b", "x", 0.0, 0.3, [], priority=0),
            record("c", "y", 0.0, 0.2, [], priority=1),
            RequestRecord("d", 0.0, "y", 1, 5, 0, 3, error="rejected")]
    by_tenant = latency_by(recs)
    assert set(by_tenant) == {"x", "y"}
    assert by_tenant["x"].mean == pytest.approx(200.0) and by_tenant["x"].count == 2
    assert by_tenant["y"].count == 1  # the rejected request has no TTFT
    by_class = latency_by(recs, by_priority, "e2e")
    assert by_class[1].median == pytest.approx(200.0)
