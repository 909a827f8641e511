"""A draft model's greedy proposal in one native call (kernels/draft_forward.c): the same
drafts and the same draft K/V as the PyTorch path over the same native linears, for every
architecture it takes; the ones it does not take stay on PyTorch; bad arrays are refused
before the C code sees them."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_exactness import check_exact
from test_spec_decode import perturbed_draft, repetitive_batch

from conveyor import LLM
from conveyor.config import CacheConfig, SpeculativeConfig, load_model_config
from conveyor.kernels import cpu as kernels
from conveyor.kernels.cpu.ops import DraftForward
from conveyor.runner.draft_model import DraftModelProposer
from conveyor.runner.model_runner import ModelRunner
from conveyor.spec.proposers import ProposeItem

from helpers import make_checkpoint

pytestmark = pytest.mark.skipif(
    kernels.load() is None or not kernels.load().gemm_f32_available(),
    reason="the native GEMM is not built on this machine")

BLOCK = 8


def proposer(arch: str, native: bool) -> DraftModelProposer:
    target = load_model_config(make_checkpoint(arch), dtype="float32")
    cfg = SpeculativeConfig("draft_model", model=perturbed_draft(seed=1, arch=arch))
    p = DraftModelProposer(cfg, target, CacheConfig(block_size=BLOCK), torch.device("cpu"),
                           "native", make_runner=ModelRunner)
    p.allocate_kv_cache(3 * 8)
    if not native:
        p.native = None  # the PyTorch path, on the same native linears and kernels
    return p


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_native_proposals_equal_the_pytorch_path(arch: str) -> None:
    """Requests of different k (the rows still drafting shrink), catch-ups of 1-5 tokens
    and, for mistral, contexts past its sliding window: every draft and every draft K/V
    row the native loop wrote equals the PyTorch path's."""
    fast, slow = proposer(arch, native=True), proposer(arch, native=False)
    assert fast.native is not None and slow.native is None
    calls = []
    real_call = type(fast.native).__call__

    def counting(self, *args):
        calls.append(args[3].tolist())
        return real_call(self, *args)

    type(fast.native).__call__ = counting
    try:
        rng = random.Random(3)
        contexts = [[rng.randrange(4, 384) for _ in range(n)] for n in (9, 23, 30)]
        ks = [4, 3, 1]
        for grow in (0, 1, 2, 5, 7, 12, 13):
            items = [ProposeItem(f"r{i}", contexts[i] + [7 + j for j in range(grow)],
                                 ks[i], list(range(8 * i, 8 * i + 8))) for i in range(3)]
            got = fast.propose_batch(items)
            want = slow.propose_batch(items)
            assert got == want, grow
            assert [len(got[f"r{i}"]) for i in range(3)] == ks
    finally:
        type(fast.native).__call__ = real_call
    # The prompt went through PyTorch (longer than a decode-row catch-up); the rest ran
    # natively, largest k first.
    assert len(calls) == 6 and all(c == sorted(c, reverse=True) for c in calls)
    for (fk, fv), (sk, sv) in zip(fast.runner.kv_caches, slow.runner.kv_caches,
                                  strict=True):
        for i, n in enumerate((9, 23, 30)):
            # Request i's blocks 8i.. hold position p at slot 8i * BLOCK + p.
            slots = torch.arange(n + 13 + ks[i] - 1) + 8 * i * BLOCK
            assert torch.equal(fk[slots], sk[slots]) and torch.equal(fv[slots], sv[slots])


def test_the_loop_attends_with_the_models_own_scale() -> None:
    """The loop's attention scale is the float the PyTorch path passes, not a 1 / sqrt(D)
    of its own (under -ffast-math an rsqrt estimate whose last bit depends on the CPU):
    with a scale no 1 / sqrt(D) gives, the K/V rows still match, on any CPU."""
    fast, slow = proposer("llama", native=True), proposer("llama", native=False)
    for p in (fast, slow):
        for layer in p.runner.model.layers:
            layer.self_attn.scale *= 0.5
    fast.native = DraftForward(fast.runner.model, fast.runner.kv_caches)
    context = [5, 9, 14, 3, 77, 21, 8, 40, 33]
    for grow in (0, 1, 2):  # the prompt through PyTorch, then the native loop
        items = [ProposeItem("r", context + [7] * grow, 3, list(range(8)))]
        assert fast.propose_batch(items) == slow.propose_batch(items)
    for (fk, fv), (sk, sv) in zip(fast.runner.kv_caches, slow.runner.kv_caches,
                                  strict=True):
        assert torch.equal(fk, sk) and torch.equal(fv, sv)


def test_a_model_the_loop_does_not_take_stays_on_pytorch() -> None:
    """qwen3's per-head q/k norms are not in the loop: its drafts go through PyTorch."""
    p = proposer("qwen3", native=True)
    assert p.native is None
    items = [ProposeItem("r", [5, 9, 14, 3, 77], 3, list(range(8)))]
    assert len(p.propose_batch(items)["r"]) == 3


def test_the_switch_turns_it_off(monkeypatch) -> None:
    monkeypatch.setenv("CONVEYOR_NATIVE_DRAFT", "0")
    assert proposer("llama", native=True).native is None


def test_bad_arrays_are_refused_before_the_kernel() -> None:
    native = proposer("llama", native=True).native
    ids, catch = np.array([5, 6], dtype=np.int64), np.array([1, 1], dtype=np.int32)
    lens0, ks = np.array([4, 4], dtype=np.int64), np.array([3, 2], dtype=np.int32)
    slots = np.arange(16, dtype=np.int64).reshape(2, 8)
    assert native(ids, catch, lens0, ks, slots).shape == (2, 3)
    bad = {
        "k ascending": (ids, catch, lens0, ks[::-1].copy(), slots),
        "a slot past the cache": (ids, catch, lens0, ks, slots + native.num_slots),
        "a token past the vocabulary": (ids + 10_000, catch, lens0, ks, slots),
        "too few slots for the drafts": (ids, catch, lens0, ks, slots[:, :5].copy()),
        "ids not matching the catch-ups": (ids[:1].copy(), catch, lens0, ks, slots),
        "int32 lengths": (ids, catch, lens0.astype(np.int32), ks, slots),
        "a catch-up of none": (ids[:1].copy(), np.array([1, 0], dtype=np.int32), lens0, ks,
                               slots),
    }
    for what, args in bad.items():
        with pytest.raises(ValueError, match="draft_propose"):
            native(*args)
            pytest.fail(f"accepted {what}")


def test_greedy_tokens_equal_transformers_through_the_native_loop() -> None:
    path = make_checkpoint("llama")
    prompts, params = repetitive_batch(seed=2)
    llm = LLM(path, dtype="float32", num_kv_blocks=24, block_size=8,
              speculative_config={"method": "draft_model", "model": perturbed_draft(seed=1),
                                  "num_speculative_tokens": 3, "adaptive": False})
    native = llm.engine.runner.proposer.native
    assert native is not None
    calls = []
    real_call = type(native).__call__
    type(native).__call__ = lambda self, *a: calls.append(1) or real_call(self, *a)
    try:
        outs = llm.generate(prompts, params)
    finally:
        type(native).__call__ = real_call
    check_exact(path, outs, prompts, params)
    assert calls  # (under preemption too: 24 blocks of 8 for 10 requests)
    assert llm.stats()["kv_blocks_in_use"] == 0
