"""The cost of structured outputs in the engine: per-step mask fill + apply at batch 1, 32
and 128 (ms and share of the step), and tokens/s of a batch where half the requests carry a
JSON schema against the same batch unconstrained, side by side in one run (alternating
rounds, so both see the same machine); the longest grammar compile, and how long any step
waited for one.

The model is random (no weights can be downloaded): a llama of ``--hidden`` and
``--layers`` with a byte-level BPE of ``--vocab`` tokens trained on the standard library
(benchmarks/structured/engines.py). At temperature 1 the constrained requests write
schema-valid JSON; the unconstrained ones write ``--max-tokens`` tokens (ignore_eos).

    PYTHONPATH=src python benchmarks/structured/step_cost.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from engines import SCHEMA, train_tokenizer

from conveyor.entrypoints.llm import LLM
from conveyor.sampling_params import SamplingParams
from conveyor.structured_outputs import StructuredOutputsParams


def checkpoint(vocab: int, hidden: int, layers: int) -> str:
    import transformers as tf
    from transformers import AutoTokenizer

    tok_dir = train_tokenizer(vocab)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    cfg = tf.LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 3,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=max(1, hidden // 256),
                         max_position_embeddings=2048, eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = tempfile.mkdtemp(prefix="so-bench-")
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


# Timing runs: an array of many records, so no constrained request ends before max_tokens
# and the batch stays the same size every step (tokens/s compare like with like).
LONG = {"type": "array", "items": SCHEMA, "minItems": 50}


def constrained(max_tokens: int, seed: int, schema: dict = LONG) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed,
                          structured_outputs=StructuredOutputsParams(json=schema))


def free(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed, ignore_eos=True)


def run(llm: LLM, params: list[SamplingParams]) -> dict:
    runner = llm.engine.core.executor.runner
    runner.timings.reset()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate([f"request {i}:" for i in range(len(params))], params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    bad = stopped = 0
    for o, p in zip(outs, params):
        if p.structured_outputs is not None and o.outputs[0].finish_reason == "stop":
            stopped += 1
            try:
                json.loads(o.outputs[0].text, strict=True)
            except ValueError:
                bad += 1
    t = runner.timings
    steps = t.counts.get("forward", 0)
    step_ms = 1e3 * sum(t.seconds.get(k, 0.0) for k in
                        ("prepare", "forward", "logits", "grammar_mask", "sample")) / max(steps, 1)
    grammar_ms = 1e3 * (t.seconds.get("grammar_mask", 0.0)
                        + t.seconds.get("grammar_accept", 0.0)) / max(steps, 1)
    # CPU seconds (this process, every thread) per token: less moved by other jobs on a
    # shared machine than wall time.
    return {"requests": len(params), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "cpu_ms_per_token": 1e3 * cpu / tokens,
            "steps": steps, "step_ms": step_ms,
            "grammar_ms_per_step": grammar_ms,
            "grammar_share": grammar_ms / step_ms if step_ms else 0.0,
            "stopped": stopped, "invalid_stopped_json": bad}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    path = checkpoint(args.vocab, args.hidden, args.layers)
    llm = LLM(path, dtype="float32", num_threads=args.threads, max_num_seqs=128,
              max_num_batched_tokens=4096, num_kv_blocks=2048)
    grammars = llm.engine.core.executor.runner.grammars
    llm.generate(["warm"], constrained(args.max_tokens, 0), use_tqdm=False)  # tokenizer
    report: dict = {"model": f"llama hidden {args.hidden}, {args.layers} layers, vocab "
                             f"{args.vocab}", "threads": args.threads}
    # Per-step cost with every request constrained.
    for batch in (1, 32, 128):
        report[f"all_constrained_batch_{batch}"] = run(
            llm, [constrained(args.max_tokens, s) for s in range(batch)])
    # Half constrained against none, alternating rounds.
    mixed, plain = [], []
    for r in range(args.rounds):
        seeds = range(r * 32, r * 32 + 32)
        mixed.append(run(llm, [constrained(args.max_tokens, s) if s % 2 else
                               free(args.max_tokens, s) for s in seeds]))
        plain.append(run(llm, [free(args.max_tokens, s) for s in seeds]))
    report["half_constrained_batch_32"] = mixed
    report["unconstrained_batch_32"] = plain
    for name, runs in (("half_constrained", mixed), ("unconstrained", plain)):
        report[f"{name}_median"] = {k: sorted(r[k] for r in runs)[len(runs) // 2]
                                    for k in ("tokens_per_s", "cpu_ms_per_token", "step_ms")}
    # Validity: the one-record schema, room to finish; every stopped output strict JSON.
    report["validity_batch_32"] = run(llm, [constrained(256, s, SCHEMA) for s in range(32)])
    # Step time is what throughput pays per token row; the constrained requests stop
    # when their JSON closes, so compare ms per step at the same batch, not tokens alone.
    report["compile_s_max"] = max(grammars.compile_s) if grammars.compile_s else None
    report["compiles"] = len(grammars.compile_s)
    report["step_wait_for_compile_s"] = grammars.wait_s
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
