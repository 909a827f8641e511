"""sjf's prompt weight: a prompt token priced against an output token in the remaining work.

Found by benchmarks/scheduling/policies.py: with prompt and output tokens priced alike, sjf ranks a
long-prompt, short-output request as a long job, though the engine serves its prompt in
a step or two and then frees the slot; the mean TTFT win over fcfs fell short.
"""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.config import EngineArgs, PolicyConfig
from conveyor.core.policies import PolicyContext, make_policy

from helpers import make_request as req


def order(policy, now: float = 0.0) -> list[str]:
    """Drain the waiting queue in the policy's order."""
    out = []
    while (r := policy.peek(now)) is not None:
        policy.pop(r)
        out.append(r.request_id)
    return out


def test_prompt_weight_prices_prefill_below_decode():
    # chat: 100-token prompt, 40 tokens out; summary: 800-token prompt, 4 tokens out.
    # (pure SJF: no aging, so no max_model_len to bind)
    same = make_policy("sjf", PolicyConfig(sjf_aging_s=0.0))  # weight 1: work 140 vs 804
    cheap = make_policy("sjf", PolicyConfig(sjf_prompt_weight=1 / 16,
                                            sjf_aging_s=0.0))  # 46.25 vs 54
    none = make_policy("sjf", PolicyConfig(sjf_prompt_weight=0.0, sjf_aging_s=0.0))  # 40 vs 4
    for p in (same, cheap, none):
        p.add(req("chat", 100, 40), 0.0)
        p.add(req("summary", 800, 4), 0.0)
    assert same.remaining_work(req("s", 800, 4)) == 804
    assert cheap.remaining_work(req("s", 800, 4)) == pytest.approx(54.0)
    assert order(same) == ["chat", "summary"]
    assert order(cheap) == ["chat", "summary"]
    assert order(none) == ["summary", "chat"]


def test_prompt_weight_applies_to_recomputation_after_preemption():
    p = make_policy("sjf", PolicyConfig(sjf_prompt_weight=0.5))
    pre = req("pre", 10, 40)
    for t in range(30):
        pre.append_output_token(t)
    assert p.remaining_work(pre) == 0.5 * 40 + 10  # 40 tokens to recompute, 10 to generate


@pytest.mark.parametrize("bad", [-0.1, float("inf"), float("nan")])
def test_bad_prompt_weight_names_the_field(bad):
    with pytest.raises(ValueError, match="sjf_prompt_weight"):
        PolicyConfig(sjf_prompt_weight=bad)


def test_cli_flag_reaches_the_policy():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--scheduling-policy", "sjf", "--sjf-prompt-weight", "0.0625"])
    assert EngineArgs.from_cli_args(args).scheduler_config().policy.sjf_prompt_weight == 0.0625


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 1000), st.floats(0, 50)),
                min_size=2, max_size=12),
       st.sampled_from([0.0, 1 / 16, 1.0, 4.0]), st.floats(0.5, 20))
def test_aging_bound_holds_for_any_prompt_weight(specs, weight, aging):
    # No request goes before one that arrived ``aging`` seconds or more before it.
    p = make_policy("sjf", PolicyConfig(sjf_prompt_weight=weight, sjf_aging_s=aging))
    p.bind(PolicyContext(max_model_len=4096))
    reqs = {str(i): req(str(i), prompt, output, arrival)
            for i, (prompt, output, arrival) in enumerate(specs)}
    for r in reqs.values():
        p.add(r, r.arrival_time)
    served = [reqs[rid].arrival_time for rid in order(p)]
    for i, earlier in enumerate(served):
        assert all(later > earlier - aging for later in served[i + 1:])
