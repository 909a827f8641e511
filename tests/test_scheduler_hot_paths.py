"""Properties behind the scheduler's and KV manager's incremental hot paths.

The scheduler sends the runner only the block ids added since the last step, the
KV manager registers only blocks not yet registered, and block hashes are computed
for all new blocks of a request at once. Driven by random workloads with shared
prefixes, preemption and eviction, at every step:

- the runner's block table, rebuilt from the diffs, equals the KV manager's;
- each request's block hashes equal the chain of ``chain_hash`` over its blocks;
- after update(), every full computed block of a request in the batch is findable
  in the prefix cache (by itself, or by another block holding the same content);
- the pool's and scheduler's invariants hold.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.config import SchedulerConfig
from conveyor.core.kv_cache_manager import KVCacheManager, chain_hash
from conveyor.core.scheduler import Scheduler
from conveyor.core.scheduler_output import ModelRunnerOutput
from conveyor.request import Request
from conveyor.sampling_params import SamplingParams

BS = 4

request_st = st.tuples(st.integers(0, 3), st.lists(st.integers(10, 99), max_size=30),
                       st.integers(1, 20), st.integers(0, 10))


def reference_hashes(kv: KVCacheManager, tokens: list[int]) -> list[bytes]:
    out, parent = [], kv._root
    for i in range(len(tokens) // kv.block_size):
        parent = chain_hash(parent, tokens[i * kv.block_size:(i + 1) * kv.block_size],
                            kv._extra)
        out.append(parent)
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(request_st, min_size=2, max_size=12), st.integers(24, 60), st.integers(2, 6),
       st.integers(8, 64), st.integers(0, 2**16))
def test_incremental_paths_agree_with_the_whole_state(reqs, num_blocks, max_seqs, budget, seed):
    prefixes = [[], [1 + seed % 7] * 24, list(range(200, 240)), [3, 4] * 10]
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget),
                      kv, max_model_len=num_blocks * BS)
    pending = sorted(((at, i, prefixes[p] + suffix or [5], out))
                     for i, (p, suffix, out, at) in enumerate(reqs))
    runner_tables: dict[str, list[int]] = {}
    step = 0
    while pending or sched.has_unfinished():
        assert step < 3000, "no progress"
        while pending and pending[0][0] <= step:
            _, i, prompt, out_len = pending.pop(0)
            sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=out_len,
                                                                      ignore_eos=True),
                                      float(step), max_tokens=out_len), float(step))
        out = sched.schedule(float(step))
        for rid in out.finished_req_ids:
            runner_tables.pop(rid, None)
        for new in out.new_reqs:
            runner_tables[new.req_id] = list(new.block_ids)
        for cached in out.cached_reqs:
            runner_tables[cached.req_id].extend(cached.new_block_ids)
        for rid in out.num_scheduled_tokens:
            assert runner_tables[rid] == kv.block_ids(rid), rid
        # A token id that varies by request, so outputs differ as a real model's would.
        run = ModelRunnerOutput({rid: [50 + int(rid[1:]) % 40] for rid in out.sampling_req_ids})
        sched.update(out, run, float(step) + 0.5)
        for rid in out.num_scheduled_tokens:
            req = sched.requests.get(rid)
            if req is None or rid not in kv.req_blocks:
                continue
            ref = reference_hashes(kv, req.all_token_ids)
            assert kv._req_hashes[rid] == ref[:len(kv._req_hashes[rid])]
            blocks = kv.req_blocks[rid]
            for i in range(min(req.num_computed_tokens // BS, len(blocks))):
                assert kv.pool.block_hash(blocks[i]) in (None, ref[i])
                assert kv.pool.lookup(ref[i]) is not None, (rid, i)
        sched.check_invariants()
        step += 1
    assert not kv.req_blocks
