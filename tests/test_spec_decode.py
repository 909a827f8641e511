"""Speculative decoding end to end: greedy tokens never change (equal transformers'),
whatever the proposer, chunking, preemption, prefix-cache hits, n > 1 or policy."""

from __future__ import annotations

import importlib.util
import random

import pytest
from test_exactness import check_exact, reference
from test_policies_exactness import POLICY_OPTIONS, workload

from conveyor import LLM, SamplingParams

from helpers import make_checkpoint

HAS_SUFFIX = importlib.util.find_spec("conveyor.spec.suffix") is not None
HAS_NATIVE_SUFFIX = importlib.util.find_spec("arctic_inference") is not None
# Fixed k, so that how much gets verified does not depend on the machine's step times
# (the adaptive choice reads them); the adaptive path runs in "adaptive".
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
              "adaptive": False},
    "suffix": {"method": "suffix", "num_speculative_tokens": 3, "adaptive": False,
               "suffix_backend": "python"},
    # Arctic Inference's trees (spec/suffix_native.py), where installed.
    "suffix_native": {"method": "suffix", "num_speculative_tokens": 3, "adaptive": False,
                      "suffix_backend": "native"},
}
CONFIGS = {
    "default": dict(),
    "chunked": dict(max_num_batched_tokens=13),
    "preempt": dict(num_kv_blocks=12, block_size=8),
    "no_prefix_cache": dict(enable_prefix_caching=False, max_num_seqs=3),
    "adaptive": dict(),  # k chosen per step from the measured step times
}


def repetitive_batch(n: int = 10, seed: int = 0):
    """Prompts that repeat themselves (so prompt lookup finds drafts), some sharing a
    prefix (prefix-cache hits), with greedy and a few long outputs."""
    rng = random.Random(seed)
    prompts, params = [], []
    shared = [rng.randrange(4, 384) for _ in range(20)]
    for i in range(n):
        motif = [rng.randrange(4, 384) for _ in range(rng.randint(2, 6))]
        body = (motif * 12)[:rng.randint(6, 40)]
        prompts.append(shared + body if i % 3 == 0 else body)
        params.append(SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.0))
    return prompts, params


def spec_config(method: str, config: str) -> dict:
    cfg = dict(METHODS[method])
    if config == "adaptive":
        cfg["adaptive"] = True
    return cfg


# Every configuration under ngram; the suffix proposer (the same scheduler path) on two.
CASES = [("ngram", c) for c in CONFIGS] + [(m, c) for m in ("suffix", "suffix_native")
                                           for c in ("default", "preempt")]


def _skip_unbuilt(method: str) -> None:
    if method == "suffix" and not HAS_SUFFIX:
        pytest.skip("suffix proposer not built")
    if method == "suffix_native" and not HAS_NATIVE_SUFFIX:
        pytest.skip("arctic_inference (native suffix trees) is not installed")


@pytest.mark.parametrize(("method", "config"), CASES)
def test_greedy_tokens_equal_transformers(method: str, config: str) -> None:
    _skip_unbuilt(method)
    path = make_checkpoint("llama")
    prompts, params = repetitive_batch()
    llm = LLM(path, dtype="float32", speculative_config=spec_config(method, config),
              **CONFIGS[config])
    outs = llm.generate(prompts, params)
    check_exact(path, outs, prompts, params)
    stats = llm.stats()
    spec = stats["spec_decode"]
    if config != "adaptive":
        assert spec["num_draft_tokens"] > 0, "the workload must exercise verification"
        assert spec["num_accepted_tokens"] > 0
    assert stats["kv_blocks_in_use"] == 0, "every block must come back"
    if config == "preempt":
        assert stats["num_preemptions"] > 0


def test_n_greater_than_one_and_logprobs() -> None:
    path = make_checkpoint("llama")
    prompts, _ = repetitive_batch(4, seed=3)
    params = SamplingParams(max_tokens=20, temperature=0.0, n=2, logprobs=2)
    off = LLM(path, dtype="float32").generate(prompts, params)
    llm = LLM(path, dtype="float32", speculative_config=METHODS["ngram"])
    on = llm.generate(prompts, params)
    for a, b, prompt in zip(off, on, prompts):
        for sa, sb in zip(a.outputs, b.outputs):
            assert sa.token_ids == sb.token_ids == reference(path, tuple(prompt), 20)
            # Logprobs of accepted drafts come from their own rows: the same numbers.
            for la, lb in zip(sa.logprobs, sb.logprobs):
                assert la.keys() == lb.keys()
                for t in la:
                    assert abs(la[t].logprob - lb[t].logprob) < 1e-4
    assert llm.stats()["spec_decode"]["num_accepted_tokens"] > 0


@pytest.mark.parametrize("policy", list(POLICY_OPTIONS))
def test_every_policy_keeps_greedy_tokens(policy: str) -> None:
    path = make_checkpoint("llama")
    llm = LLM(path, dtype="float32", scheduling_policy=policy, **POLICY_OPTIONS[policy],
              num_kv_blocks=12, block_size=8, speculative_config=METHODS["ngram"])
    engine = llm.engine
    now = [0.0]
    engine.clock = lambda: now[0]  # virtual time: the same order of work on any machine
    prompts, params, sched = workload()
    results = {}
    for i in range(len(prompts)):
        engine.add_request({"prompt_token_ids": prompts[i]}, params[i], request_id=str(i),
                           **sched[i])
    while engine.has_unfinished_requests():
        now[0] += 0.005
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
    check_exact(path, [results[str(i)] for i in range(len(prompts))], prompts, params)
    stats = llm.stats()
    assert stats["kv_blocks_in_use"] == 0
    if policy == "slo":  # drafts asked the SLO budget controller (one decision with chunks)
        budget = stats["token_budget"]
        assert budget["num_admitted_extra"] + budget["num_refused_extra"] > 0


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch() -> None:
    path = make_checkpoint("llama")
    prompts, _ = repetitive_batch(6, seed=5)
    seeded = SamplingParams(max_tokens=24, temperature=0.8, seed=7)
    llm = LLM(path, dtype="float32", speculative_config=METHODS["ngram"])
    alone = llm.generate([prompts[0]], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=24, temperature=1.0)] * 5
    mixed = llm.generate(prompts, [seeded, *others])[0].outputs[0].token_ids
    assert alone == mixed


def test_a_bad_speculative_config_is_refused_before_loading() -> None:
    with pytest.raises(ValueError, match="method"):
        LLM("tiny", load_format="dummy", speculative_config={"method": "eagle"})
    with pytest.raises(ValueError, match="unknown key"):
        LLM("tiny", load_format="dummy",
            speculative_config={"method": "ngram", "num_spec_tokens": 3})
    with pytest.raises(ValueError, match="model"):
        LLM("tiny", load_format="dummy", speculative_config={"method": "draft_model"})


# ---- draft model ---------------------------------------------------------------------------
def perturbed_draft(noise: float = 0.03, seed: int = 0, arch: str = "llama") -> str:
    """The tiny ``arch`` target with noise on its weights: a draft that agrees often but
    not always."""
    import shutil
    import tempfile

    import torch
    import transformers as tf

    path = make_checkpoint(arch)
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.add_(torch.randn(p.shape, generator=gen) * noise)
    out = tempfile.mkdtemp(prefix=f"conveyor-draft-{arch}-")
    model.save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        src = f"{path}/{f}"
        if __import__("os").path.isfile(src):
            shutil.copy(src, out)
    return out


def test_draft_model_greedy_tokens_equal_transformers() -> None:
    path = make_checkpoint("llama")
    prompts, params = repetitive_batch(seed=1)
    llm = LLM(path, dtype="float32", num_kv_blocks=24, block_size=8,
              speculative_config={"method": "draft_model", "model": perturbed_draft(),
                                  "num_speculative_tokens": 3, "adaptive": False})
    outs = llm.generate(prompts, params)
    check_exact(path, outs, prompts, params)
    spec = llm.stats()["spec_decode"]
    # Both paths ran: some drafts accepted, some rejected.
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"]
    assert llm.stats()["kv_blocks_in_use"] == 0


def test_draft_equal_to_the_target_is_always_accepted() -> None:
    """Greedy acceptance 100%, and k + 1 tokens per decode step."""
    path = make_checkpoint("llama")
    k, new = 3, 41
    llm = LLM(path, dtype="float32", speculative_config={
        "method": "draft_model", "model": path, "num_speculative_tokens": k,
        "adaptive": False})
    prompt = [5, 9, 14, 3, 77, 120]
    out = llm.generate([prompt], SamplingParams(max_tokens=new, temperature=0.0,
                                                 ignore_eos=True))[0]
    assert out.outputs[0].token_ids == reference(path, tuple(prompt), new)
    stats = llm.stats()
    spec = stats["spec_decode"]
    assert spec["num_accepted_tokens"] == spec["num_draft_tokens"] > 0
    # One step for the prompt (its first token), then k + 1 tokens per step.
    assert stats["num_steps"] == 1 + -(-(new - 1) // (k + 1))


def test_a_draft_with_another_tokenizer_is_refused() -> None:
    path = make_checkpoint("llama")
    other_vocab = make_checkpoint("llama", vocab_size=400)
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        LLM(path, dtype="float32",
            speculative_config={"method": "draft_model", "model": other_vocab})


def test_cli_flag_and_metrics() -> None:
    import argparse

    from conveyor.config import EngineArgs
    from conveyor.metrics import EngineMetrics

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, '
                                 '"prompt_lookup_min": 1, "adaptive": false}']))
    assert args.speculative.method == "ngram" and args.speculative.num_speculative_tokens == 2
    path = make_checkpoint("llama")
    llm = LLM(path, dtype="float32", speculative_config=args.speculative)
    prompts, params = repetitive_batch(4, seed=2)
    llm.generate(prompts, params)
    stats = llm.stats()
    metrics = EngineMetrics()
    metrics.update_stats(stats)
    text = metrics.render().decode()
    spec = stats["spec_decode"]
    assert (f'conveyor:spec_decode_num_draft_tokens_total{{method="ngram"}} '
            f'{float(spec["num_draft_tokens"])}') in text
    assert (f'conveyor:spec_decode_num_accepted_tokens_total{{method="ngram"}} '
            f'{float(spec["num_accepted_tokens"])}') in text
    assert spec["num_draft_tokens"] > 0


def test_stop_strings_cut_the_same_text_and_tokens() -> None:
    """Several tokens arrive per step: the front end still stops at the same place."""
    path = make_checkpoint("llama")
    prompts, _ = repetitive_batch(8, seed=4)
    off = LLM(path, dtype="float32")
    on = LLM(path, dtype="float32", speculative_config=METHODS["ngram"])
    base = off.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0))
    stops = [o.outputs[0].text[len(o.outputs[0].text) // 2:][:3] or "zzz" for o in base]
    for include in (False, True):
        params = [SamplingParams(max_tokens=40, temperature=0.0, stop=[s],
                                 include_stop_str_in_output=include) for s in stops]
        for a, b in zip(off.generate(prompts, params), on.generate(prompts, params)):
            assert (a.outputs[0].text, a.outputs[0].token_ids, a.outputs[0].finish_reason) \
                == (b.outputs[0].text, b.outputs[0].token_ids, b.outputs[0].finish_reason)
    assert any(o.outputs[0].finish_reason == "stop" for o in on.generate(prompts, params))
    assert on.stats()["spec_decode"]["num_accepted_tokens"] > 0


def test_draft_model_draws_from_its_distribution_at_temperature() -> None:
    """A random request's drafts come from the draft's q, verified with min(1, p / q):
    with the target as its own draft nearly every draft survives (p == q up to the
    rounding of a batched forward), where argmax drafts survive only as often as the
    argmax is what the target samples."""
    path = make_checkpoint("llama")
    cfg = {"method": "draft_model", "model": path, "num_speculative_tokens": 3,
           "adaptive": False}
    prompts = [[5, 9, 14, 3, 77, 120], [8, 8, 30, 2], [100, 7, 61]]
    hot = SamplingParams(max_tokens=30, temperature=2.0, ignore_eos=True)
    llm = LLM(path, dtype="float32", speculative_config=cfg)
    llm.generate(prompts, hot)
    drawn = llm.stats()["spec_decode"]
    assert drawn["num_draft_tokens"] > 40 and drawn["acceptance_rate"] > 0.95
    argmax = LLM(path, dtype="float32", speculative_config=cfg)
    argmax.engine.runner.proposer._draw = lambda *a, **k: None  # keep the argmax drafts
    argmax.engine.runner.proposer.last_probs = {}
    real_batch = argmax.engine.runner.proposer.propose_batch

    def one_hot(items):
        out = real_batch(items)
        argmax.engine.runner.proposer.last_probs = {}  # verified as one-hot proposals
        return out

    argmax.engine.runner.proposer.propose_batch = one_hot
    argmax.generate(prompts, hot)
    assert argmax.stats()["spec_decode"]["acceptance_rate"] < 0.8


@pytest.mark.parametrize("method", ["ngram", "suffix", "suffix_native", "draft_model",
                                    "draft_adaptive"])
def test_seeded_sampling_with_speculation_equals_it_without(method: str) -> None:
    """A seeded request's output is its output without speculation, token for token
    (verification is coupled to the sampler's own draws), whatever the batch, the draft
    length or the proposer; the others in the batch are merely random."""
    _skip_unbuilt(method)
    path = make_checkpoint("llama")
    if method.startswith("draft"):
        cfg = {"method": "draft_model", "model": perturbed_draft(), "num_speculative_tokens": 3,
               "adaptive": method == "draft_adaptive"}
    else:
        cfg = METHODS[method]
    prompts, _ = repetitive_batch(5, seed=3)
    seeded = [SamplingParams(max_tokens=20, temperature=t, seed=11 + i, top_k=k)
              for i, (t, k) in enumerate([(0.9, 0), (1.3, 0), (0.7, 5)])]
    off = LLM(path, dtype="float32")
    want = [o.outputs[0].token_ids for o in off.generate(prompts[:3], seeded)]
    llm = LLM(path, dtype="float32", speculative_config=cfg)
    alone = llm.generate([prompts[0]], seeded[0])[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=20, temperature=1.0)] * 2
    mixed = [o.outputs[0].token_ids for o in llm.generate(prompts, [*seeded, *others])]
    assert alone == want[0] and mixed[:3] == want
    spec = llm.stats()["spec_decode"]
    if method == "draft_adaptive":
        # Whether drafts pay is the controller's measurement of this machine's steps, so
        # it may verify none here: the draft model did propose (before any plan, a request
        # proposes the full length), and the fixed-length case above verifies drafts.
        assert spec["num_proposed_tokens"] > 0
    else:
        assert spec["num_accepted_tokens"] > 0  # speculation did produce some of them
    assert llm.stats()["kv_blocks_in_use"] == 0


def test_a_draft_model_shares_the_pool_without_costing_the_target_concurrency() -> None:
    """Each block holds both models' layers: where memory is plentiful (the CPU default,
    capped at what max_num_seqs full sequences use) the pool keeps that many blocks; where
    memory binds (kv_cache_memory), the draft's layers take their share of it."""
    path = make_checkpoint("llama")
    cfg = {"method": "draft_model", "model": perturbed_draft(), "num_speculative_tokens": 3}
    kw = dict(dtype="float32", max_num_seqs=8, max_model_len=128)
    plain = LLM(path, **kw).engine.config
    with_draft = LLM(path, speculative_config=cfg, **kw).engine.config
    assert with_draft.cache.num_kv_blocks == plain.cache.num_kv_blocks == 8 * 128 // 16
    per_token = plain.model.kv_bytes_per_token  # the draft here is the target's shape
    tight = dict(kw, kv_cache_memory=40 * 16 * per_token)
    assert LLM(path, **tight).engine.config.cache.num_kv_blocks == 40
    assert LLM(path, speculative_config=cfg, **tight).engine.config.cache.num_kv_blocks == 20


@pytest.mark.parametrize("attention", ["auto", "sdpa"])
def test_draft_model_proposals_do_not_depend_on_the_batch_or_the_catch_up_path(
        attention: str) -> None:
    """The draft proposer's fast path (inputs of every draft position cut from one slot
    layout, rows drafting fewer positions dropping out, a short catch-up as decode rows):
    a request's greedy drafts are the same proposed alone or beside others of other
    lengths, and the same whether its catch-up runs as decode rows or as a prefill
    segment; with the native decode kernel and with SDPA's (which reads a mask)."""
    import torch

    from conveyor.config import CacheConfig, SpeculativeConfig, load_model_config
    from conveyor.runner.draft_model import DraftModelProposer
    from conveyor.runner.model_runner import ModelRunner
    from conveyor.spec.proposers import ProposeItem

    path = make_checkpoint("llama")
    target = load_model_config(path, dtype="float32")
    cfg = SpeculativeConfig("draft_model", model=perturbed_draft())
    rng = random.Random(5)
    contexts = [[rng.randrange(4, 384) for _ in range(n)] for n in (9, 23, 40)]
    ks = [4, 1, 3]

    def proposer(catch_up_rows: int) -> DraftModelProposer:
        p = DraftModelProposer(cfg, target, CacheConfig(block_size=8), torch.device("cpu"),
                               attention, make_runner=ModelRunner)
        p.DECODE_ROWS_CATCH_UP = catch_up_rows
        p.allocate_kv_cache(3 * 8)
        return p

    def run(p: DraftModelProposer, which: list[int], grow: int) -> dict[str, list[int]]:
        items = [ProposeItem(f"r{i}", contexts[i] + [7] * grow, ks[i],
                             list(range(8 * i, 8 * i + 8))) for i in which]
        return p.propose_batch(items)

    alone, together, prefill = proposer(8), proposer(8), proposer(0)
    for grow in (0, 1, 3, 8):  # the prompt, then catch-ups of 1, 2 and 5 tokens
        want = {}
        for i in range(3):
            want.update(run(alone, [i], grow))
        assert run(together, [0, 1, 2], grow) == want
        if grow == 0:  # a prompt's catch-up: no steady proposal's work
            assert not together.last_steady and not alone.last_steady
        assert run(prefill, [0, 1, 2], grow) == want
        assert [len(want[f"r{i}"]) for i in range(3)] == ks


def test_a_draft_proposal_is_steady_only_when_it_caught_up_on_the_last_step() -> None:
    """The price of a draft (``ProposalCost``) sees steady proposals only: a catch-up of
    the token or two the last step added. A prompt, or the text of a pause, is not."""
    import torch

    from conveyor.config import CacheConfig, SpeculativeConfig, load_model_config
    from conveyor.runner.draft_model import DraftModelProposer
    from conveyor.runner.model_runner import ModelRunner
    from conveyor.spec.proposers import ProposeItem

    path = make_checkpoint("llama")
    p = DraftModelProposer(SpeculativeConfig("draft_model", model=perturbed_draft()),
                           load_model_config(path, dtype="float32"),
                           CacheConfig(block_size=8), torch.device("cpu"),
                           make_runner=ModelRunner)
    p.allocate_kv_cache(8)
    ctx = [5, 9, 14, 3, 77, 120, 40]

    def propose(tokens: list[int]) -> list[int]:
        return p.propose_batch([ProposeItem("r", tokens, 3, list(range(8)))])["r"]

    def other_than(token: int) -> int:
        return 11 if token != 11 else 12

    drafts = propose(ctx)
    assert not p.last_steady  # the prompt
    ctx.append(other_than(drafts[0]))  # draft 1 rejected: a catch-up of 1
    drafts = propose(ctx)
    assert p.last_steady
    ctx += [drafts[0], other_than(drafts[1])]  # draft 1 accepted, 2 rejected: again 1
    drafts = propose(ctx)
    assert p.last_steady
    ctx.append(other_than(drafts[0]))  # then a pause: four steps without proposing
    ctx += [21, 22, 23, 24]
    propose(ctx)
    assert not p.last_steady
