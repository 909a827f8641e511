"""The start-up warmup step (vLLM's dummy run): one full step through the real path that
leaves no trace: no request, no block held or cached, no counter moved, no random draw."""

from __future__ import annotations

from conveyor import LLM, SamplingParams
from conveyor.config import EngineArgs
from conveyor.engine.llm_engine import LLMEngine


def _engine(**kw) -> LLMEngine:
    return LLMEngine(EngineArgs(model="tiny", load_format="dummy", dtype="float32", **kw))


def test_warmup_leaves_no_trace_and_changes_no_output() -> None:
    prompts = [{"prompt_token_ids": [0] * 40}, {"prompt_token_ids": [7, 3, 9, 1, 4]}]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True),  # engine RNG
              SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)]
    results = {}
    for warmup in (False, True):
        llm = LLM("tiny", load_format="dummy", dtype="float32", warmup=warmup,
                  max_num_batched_tokens=96, max_model_len=64)
        engine = llm.engine
        assert engine.kv.num_free_blocks == engine.config.cache.num_kv_blocks
        assert not engine.runner.requests and not engine.scheduler.running
        assert engine.num_prompt_tokens == 0 and engine.scheduler.stats.total_scheduled_tokens == 0
        outs = [llm.generate(prompts, p) for p in params]
        results[warmup] = [[o.outputs[0].token_ids for o in out] for out in outs]
        # The all-zeros warmup prompt was not cached: the zeros prompt hit nothing.
        assert outs[0][0].num_cached_tokens == 0
    assert results[True] == results[False]


def test_warmup_runs_the_token_budget_in_prompts_of_the_model_length() -> None:
    engine = _engine(warmup=False, max_num_batched_tokens=300, max_model_len=128)
    assert engine.runner.warmup(300, 127) == 300
    assert not engine.runner.requests
    # A pool too small for the budget: as many whole prompts as fit.
    small = _engine(warmup=False, num_kv_blocks=10, block_size=16)
    assert small.runner.warmup(512, 100) == 100  # one prompt of 100 (7 blocks), not two
