"""A policy changes the order of work, never the tokens: under every policy, with
preemption, chunked prefill, prefix-cache hits and urgent late arrivals, greedy
outputs equal transformers'."""

from __future__ import annotations

import random

import pytest
from test_exactness import check_exact, mixed_batch

from conveyor import LLM

from helpers import make_checkpoint

POLICY_OPTIONS = {
    "fcfs": {},
    "sjf": dict(sjf_aging_s=2.0),
    "priority": {},
    "fair": dict(tenant_weights={"t1": 2.0}),
    "edf": dict(default_slo_ttft_ms=50.0),
    "lpm": dict(lpm_window=4),
    # The budget controller on (a linear step-cost model): it cuts chunks to the targets.
    "slo": dict(default_slo_ttft_ms=50.0, default_slo_tpot_ms=6.0,
                slo_cost_model="linear:0.002,2e-4,0"),
}
POOLS = {
    "preempt": dict(num_kv_blocks=9, block_size=8),  # 72 slots: running requests collide
    "chunked": dict(max_num_batched_tokens=13, max_num_seqs=3),  # few slots, long prefills
    # Prefills sharing steps: two partial ones at most, the other long ones paused.
    "split": dict(max_num_batched_tokens=16, max_num_seqs=6, long_prefill_token_threshold=6,
                  max_num_partial_prefills=2, max_long_partial_prefills=2,
                  long_prefill_min_share=0.25),
}


def workload(seed: int = 0):
    """The exactness suite's mixed batch plus requests sharing prefixes with it, split
    into an early wave and a later, more urgent one with tighter targets."""
    prompts, params = mixed_batch(n=10, seed=seed)
    rng = random.Random(seed)
    base = prompts[0] + prompts[1]
    for k in (16, 24, 17):  # a block-aligned prefix, a longer one, one block + 1
        prompts.append(base[:k] + [rng.randrange(4, 384) for _ in range(3)])
        params.append(params[0].clone(max_tokens=rng.randint(2, 12)))
    sched = []
    for i, sp in enumerate(params):
        late = i % 2 == 1
        sched.append(dict(priority=0 if late else 2, tenant=f"t{i % 3}",
                          slo_ttft_ms=20.0 if late else None))
        if i % 3 == 0:
            params[i] = sp.clone(expected_output_tokens=rng.randint(1, 30))
    return prompts, params, sched


@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("policy", list(POLICY_OPTIONS))
def test_policy_never_changes_tokens(policy: str, pool: str) -> None:
    path = make_checkpoint("llama")
    llm = LLM(path, dtype="float32", scheduling_policy=policy, **POLICY_OPTIONS[policy],
              **POOLS[pool])
    engine = llm.engine
    # A virtual clock, 5 ms a step: deadlines and aging, hence the order of work, are the
    # same however fast the machine runs the model.
    now = [0.0]
    engine.clock = lambda: now[0]
    prompts, params, sched = workload()
    results = {}

    def step() -> None:
        now[0] += 0.005
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out

    for i in range(len(prompts)):
        engine.add_request({"prompt_token_ids": prompts[i]}, params[i], request_id=str(i),
                           **sched[i])
        if i % 2 == 1:
            step()  # the urgent odd ones arrive while the early ones run
    while engine.has_unfinished_requests():
        step()
    outs = [results[str(i)] for i in range(len(prompts))]
    check_exact(path, outs, prompts, params)
    if pool == "split":  # the new chunk boundaries were exercised
        stats = engine.core.stats()
        assert stats["num_paused_prefills"] > 0 and stats["peak_partial_prefills"] == 2
    stats = llm.stats()
    assert stats["kv_blocks_in_use"] == 0, "every block must come back"
    assert stats["scheduling_policy"] == policy
    if pool == "preempt":
        assert stats["num_preemptions"] > 0, "the tiny pool should have forced preemptions"
    if policy == "priority" and pool == "chunked":
        assert stats["num_admission_preemptions"] > 0, "urgent arrivals should preempt"
    if pool == "chunked":
        assert stats["prefix_cache_hits"] > 0
    if policy == "slo":
        assert stats["token_budget"]["num_time_bound"] > 0, "the controller should cut"

