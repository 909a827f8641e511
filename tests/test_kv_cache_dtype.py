"""``--kv-cache-dtype fp8_e4m3 | fp8_e5m2 | int8``: logits within a stated bound of the
float cache's, and the pool holds ~4x the tokens of a float32 cache (~2x of bf16)."""

from __future__ import annotations

import pytest
import torch

from conveyor import LLM, SamplingParams

from helpers import make_checkpoint, random_prompts

# Largest |logit difference| against the float32 cache over the tests' prompts, whose
# logits reach |2.3|: measured 0.021 (int8), 0.12 (fp8_e4m3), 0.18 (fp8_e5m2) on the
# tiny checkpoints; the bounds leave about 2x. A token's elements are scaled by its
# head's absmax: int8 errs by up to 1/254 of it, e4m3 by 2^-4 relative, e5m2 by 2^-3.
BOUNDS = {"int8": 0.05, "fp8_e4m3": 0.25, "fp8_e5m2": 0.4}


def _first_token_logits(path: str, kv: str, prompts, **kw) -> dict[str, torch.Tensor]:
    """Each prompt's first sampled token's logits, the prompt prefilled in chunks of 13
    tokens (every chunk after the first reads the earlier ones from the cache)."""
    llm = LLM(path, dtype="float32", kv_cache_dtype=kv, max_num_batched_tokens=13, **kw)
    runner = llm.engine.runner
    runner.record_logits = True
    for i, p in enumerate(prompts):
        llm.engine.add_request({"prompt_token_ids": p},
                               SamplingParams(max_tokens=1, temperature=0.0),
                               request_id=str(i))
    out: dict[str, torch.Tensor] = {}
    for _ in range(200):
        if not (llm.engine.scheduler.num_waiting or llm.engine.scheduler.running):
            break
        llm.engine.step()
        out.update({k: v.clone() for k, v in runner.last_logits.items()})
    assert len(out) == len(prompts)
    return out


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_quantized_kv_logits_within_bound_of_float_cache(arch):
    path = make_checkpoint(arch)
    prompts = random_prompts(6, lo=20, hi=70, seed=3)
    prompts.append(list(prompts[0]))  # a prefix-cache hit: the whole prompt from cache
    ref = _first_token_logits(path, "auto", prompts)
    for kv, bound in BOUNDS.items():
        got = _first_token_logits(path, kv, prompts)
        err = max((got[k] - ref[k]).abs().max().item() for k in ref)
        assert 0 < err <= bound, f"{kv}: {err}"
        llm_kinds = {k: v.argmax().item() for k, v in got.items()}
        assert len(llm_kinds) == len(prompts)


def test_quantized_pool_holds_more_tokens():
    path = make_checkpoint("qwen3")  # head_dim 32
    memory = 2 << 20
    blocks, itemsizes = {}, {}
    for dtype in ("float32", "bfloat16"):
        for kv in ("auto", "int8", "fp8"):
            llm = LLM(path, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory=memory,
                      warmup=False)
            blocks[dtype, kv] = llm.stats()["num_kv_blocks"]
            # (bfloat16 computes in float32 on a CPU without bf16: a float32 cache)
            itemsizes[dtype] = 4 if llm.engine.runner.cfg.math_dtype == "float32" else 2
            cache = llm.engine.runner.kv_caches[0][0]
            if kv != "auto":
                assert cache.data.element_size() == 1
                assert cache.data.dtype == (torch.int8 if kv == "int8"
                                            else torch.float8_e4m3fn)
    d = 32
    for dtype, itemsize in itemsizes.items():
        ratio = blocks[dtype, "int8"] / blocks[dtype, "auto"]
        assert abs(ratio - itemsize * d / (d + 4)) < 0.05, (dtype, ratio)
        assert blocks[dtype, "fp8"] == blocks[dtype, "int8"]


def test_quantized_kv_errors():
    path = make_checkpoint("qwen3")
    with pytest.raises(ValueError, match="sdpa"):
        LLM(path, dtype="float32", kv_cache_dtype="int8", attention_backend="native")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(path, dtype="float32", kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv-role"):
        LLM(path, dtype="float32", kv_cache_dtype="int8", kv_role="prefill")
