"""The fused decode-attention kernel: same math as SDPA, and no compile while serving."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from conveyor import LLM, SamplingParams
from conveyor.model import decode_attention


def paged_case(batch: int, hq: int, hkv: int, d: int, block: int, dtype: torch.dtype,
               seed: int = 0):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    lens = [rng.randint(1, 90) for _ in range(batch)]
    num_blocks = sum(-(-n // block) for n in lens) + 3
    k_cache = torch.randn(num_blocks * block, hkv, d, dtype=dtype)
    v_cache = torch.randn(num_blocks * block, hkv, d, dtype=dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    max_len = max(lens)
    cols = torch.arange(max_len)
    slots = torch.zeros(batch, max_len, dtype=torch.long)
    for b, n in enumerate(lens):
        table = torch.tensor([free.pop() for _ in range(-(-n // block))])
        slots[b] = table[(cols // block).clamp(max=len(table) - 1)] * block + cols % block
    mask = cols[None, :] < torch.tensor(lens)[:, None]
    slots = torch.where(mask, slots, torch.zeros_like(slots))  # padding reads slot 0
    q = torch.randn(batch, hq, d, dtype=dtype)
    return q, k_cache, v_cache, slots, mask


def sdpa_reference(q, k_cache, v_cache, slots, mask, scale):
    k = k_cache[slots].transpose(1, 2).float()
    v = v_cache[slots].transpose(1, 2).float()
    out = F.scaled_dot_product_attention(q.float().unsqueeze(2), k, v, scale=scale,
                                         attn_mask=mask[:, None, None, :], enable_gqa=True)
    return out.squeeze(2)


@pytest.mark.parametrize("batch, hq, hkv, d, block", [
    (1, 4, 4, 16, 16), (5, 8, 2, 32, 4), (9, 9, 3, 64, 16), (2, 6, 1, 8, 1)])
def test_compiled_kernel_matches_sdpa(batch, hq, hkv, d, block) -> None:
    case = paged_case(batch, hq, hkv, d, block, torch.float32, seed=batch)
    want = sdpa_reference(*case, d ** -0.5)
    got = decode_attention.compiled_decode_attention()(*case, d ** -0.5)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    eager = decode_attention.decode_attention_reference(*case, d ** -0.5)
    torch.testing.assert_close(eager, want, atol=2e-6, rtol=1e-5)


def test_serving_never_compiles_after_warm_up() -> None:
    import torch._dynamo.utils as dynamo_utils

    llm = LLM("tiny", attention_backend="compiled")
    before = dynamo_utils.counters["stats"]["unique_graphs"]
    prompts = [[5 + i] * (1 + 7 * i) for i in range(9)]
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 [SamplingParams(max_tokens=3 + i, ignore_eos=True) for i in range(9)])
    llm.generate([{"prompt_token_ids": [9, 9]}], SamplingParams(max_tokens=5, ignore_eos=True))
    assert dynamo_utils.counters["stats"]["unique_graphs"] == before
