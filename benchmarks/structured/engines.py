"""xgrammar against llguidance on this CPU: compile time and per-step mask fill for a JSON
schema at batch 1 and 32, and whether random walks under each engine's mask parse with a
strict JSON parser (RFC 8259: no raw control characters inside strings).

No tokenizer can be downloaded, so a byte-level BPE of ``--vocab`` tokens is trained here
on Python's own standard library sources (a code-and-prose vocabulary of realistic size).

    PYTHONPATH=src python benchmarks/structured/engines.py --vocab 32000
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sysconfig
import tempfile
import time
from importlib.metadata import version

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "role", "active"],
    "additionalProperties": False,
}


def train_tokenizer(vocab: int) -> str:
    """A byte-level BPE trained on the standard library; returns its directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:300]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    path = tempfile.mkdtemp(prefix="so-tok-")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    return path


def timed(fn, repeat: int) -> float:
    """Median seconds of ``repeat`` calls."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def walk(n_tokens: int, fill, accept, decode, rng: random.Random, vocab: int, bitmask,
         terminated) -> str:
    """A random walk under the mask (uniform over allowed tokens): what a random model at
    temperature 1 would write."""
    ids = []
    for _ in range(n_tokens):
        if terminated():
            break
        fill()
        allowed = torch.nonzero(_unpack(bitmask[0], vocab)).flatten().tolist()
        tok = rng.choice(allowed)
        accept(tok)
        ids.append(tok)
    return decode(ids)


def batch_walk_ms(matchers, fill, apply, bitmask, accept, done, vocab: int,
                  rng: random.Random, max_steps: int = 60) -> dict:
    """ms per step (mean, median, max) of filling and applying the batch's masks while every matcher
    walks at random under its mask (each step starts where the last one left)."""
    logits = torch.randn(len(matchers), vocab)
    times, fills = [], []
    for _ in range(max_steps):
        active = [i for i, m in enumerate(matchers) if not done(m)]
        if not active:
            break
        t0 = time.perf_counter()
        fill(active)
        t1 = time.perf_counter()
        apply(logits, bitmask)
        times.append(time.perf_counter() - t0)
        fills.append(t1 - t0)
        for i in active:
            allowed = torch.nonzero(_unpack(bitmask[i], vocab)).flatten().tolist()
            accept(matchers[i], rng.choice(allowed))
    times.sort()
    fills.sort()
    return {"mean": sum(times) / len(times) * 1e3, "median": times[len(times) // 2] * 1e3,
            "max": times[-1] * 1e3, "fill_median": fills[len(fills) // 2] * 1e3,
            "steps": len(times)}


def _unpack(row: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = (row.view(-1, 1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:vocab].bool()


def strict_json_walks(walks: int, new_matcher, allocate, fill, accept, done, hf,
                      rng: random.Random, vocab: int) -> dict:
    """``walks`` random walks of up to 400 tokens, each with a fresh matcher; of those that
    reach the grammar's end, how many are not strict JSON (RFC 8259), and one example."""
    finished, bad, texts = 0, 0, []
    for _ in range(walks):
        m, bm = new_matcher(), allocate(1, vocab)
        text = walk(400, lambda m=m, bm=bm: fill(m, bm), lambda t, m=m: accept(m, t),
                    lambda ids: hf.decode([t for t in ids if t != hf.eos_token_id]),
                    rng, vocab, bm, lambda m=m: done(m))
        if done(m):
            bad += not _strict_ok(text)
            finished += 1
        texts.append(text)
    return {"walks": walks, "walks_finished": finished, "finished_not_strict_json": bad,
            "example_bad": next((t for t in texts if not _strict_ok(t)), None)}


def bench_xgrammar(tok_path: str, batch_sizes: list[int], walks: int, seed: int) -> dict:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_path)
    vocab = len(hf)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab,
                                              stop_token_ids=[hf.eos_token_id])
    out: dict = {"engine": f"xgrammar {version('xgrammar')}"}
    t0 = time.perf_counter()
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    out["compiler_init_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    out["compile_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile_builtin_json_grammar()
    out["compile_json_object_s"] = time.perf_counter() - t0
    rng = random.Random(seed)
    fill_ms = {}
    batch = xgr.BatchGrammarMatcher(max_threads=1)
    for b in [0, *batch_sizes]:  # 0: a warm-up walk of 8 (lazy automata), reported apart
        key, b = (b, b) if b else ("warmup_8", 8)
        matchers = [xgr.GrammarMatcher(compiled) for _ in range(b)]
        bitmask = xgr.allocate_token_bitmask(b, vocab)

        def fill(active, matchers=matchers, bitmask=bitmask):
            batch.batch_fill_next_token_bitmask([matchers[i] for i in active], bitmask,
                                                indices=active)
        fill_ms[key] = batch_walk_ms(matchers, fill, xgr.apply_token_bitmask_inplace, bitmask,
                                   lambda m, t: m.accept_token(t),
                                   lambda m: m.is_terminated(), vocab, rng)
    out["fill_apply_ms"] = fill_ms
    out.update(strict_json_walks(
        walks, lambda: xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask,
        lambda m, bm: m.fill_next_token_bitmask(bm), lambda m, t: m.accept_token(t),
        lambda m: m.is_terminated(), hf, rng, vocab))
    return out


def bench_llguidance(tok_path: str, batch_sizes: list[int], walks: int, seed: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok_path)
    vocab = len(hf)
    out: dict = {"engine": f"llguidance {llguidance.get_version()}"}
    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    out["compiler_init_s"] = time.perf_counter() - t0
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    t0 = time.perf_counter()
    llguidance.LLMatcher(lltok, grammar)
    out["compile_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(
        '{"type": "object"}'))
    out["compile_json_object_s"] = time.perf_counter() - t0
    rng = random.Random(seed)
    fill_ms = {}
    executor = llguidance.LLExecutor(num_threads=1)
    for b in [0, *batch_sizes]:  # 0: a warm-up walk of 8 (lazy automata), reported apart
        key, b = (b, b) if b else ("warmup_8", 8)
        matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(b)]
        bitmask = lt.allocate_token_bitmask(b, vocab)

        def fill(active, matchers=matchers, bitmask=bitmask):
            lt.fill_next_token_bitmask_par(executor, [(matchers[i], i) for i in active],
                                           bitmask)
        fill_ms[key] = batch_walk_ms(matchers, fill, lt.apply_token_bitmask_inplace, bitmask,
                                   lambda m, t: m.consume_token(t),
                                   lambda m: m.is_stopped(), vocab, rng)
    out["fill_apply_ms"] = fill_ms
    out.update(strict_json_walks(
        walks, lambda: llguidance.LLMatcher(lltok, grammar), lt.allocate_token_bitmask,
        lambda m, bm: lt.fill_next_token_bitmask(m, bm, 0), lambda m, t: m.consume_token(t),
        lambda m: m.is_stopped(), hf, rng, vocab))
    return out


def _strict_ok(text: str) -> bool:
    try:
        json.loads(text, strict=True)
        return True
    except ValueError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--walks", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    tok_path = train_tokenizer(args.vocab)
    for bench in (bench_xgrammar, bench_llguidance):
        print(json.dumps(bench(tok_path, [1, 32, 128], args.walks, args.seed), default=str))


if __name__ == "__main__":
    main()
