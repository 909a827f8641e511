"""The cost of structured outputs in the engine: per-step mask fill + apply at batch 1, 32
and 128 (ms and share of the step), and tokens/s of a batch where half the requests carry a
JSON schema against the same batch unconstrained, side by side in one run (alternating
rounds, so both see the same machine); the longest grammar compile, and how long any step
waited for one.

The model is random (no weights can be downloaded): a llama of ``--hidden`` and
``--layers`` with a byte-level BPE of ``--vocab`` tokens trained on the standard library
(benchmarks/structured/engines.py). At temperature 1 the constrained requests write
schema-valid JSON; the unconstrained ones write ``--max-tokens`` tokens (ignore_eos).

``compile_overlap``: a batch of free requests decoding when a request with a large schema
never seen before arrives; while its grammar compiles it waits outside the batch
(core/grammar_gate.py), so the others keep stepping: the report gives its compile time,
the steps the others took meanwhile, and the longest of those steps against the median.

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
    fill0 = runner.grammars.fill_s
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
    # The fill's time on the mask thread: it overlaps the forward pass in wall time, but
    # takes CPU from it on a machine with as many threads as cores.
    fill_ms = 1e3 * (runner.grammars.fill_s - fill0) / max(steps, 1)
    # CPU seconds (this process, every thread) per token: less moved by other jobs on a
    # shared machine than wall time.
    return {"requests": len(params), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "cpu_ms_per_token": 1e3 * cpu / tokens,
            "steps": steps, "step_ms": step_ms,
            "grammar_ms_per_step": grammar_ms,
            "grammar_share": grammar_ms / step_ms if step_ms else 0.0,
            "mask_fill_ms_per_step": fill_ms,
            "stopped": stopped, "invalid_stopped_json": bad}


def big_schema(n: int, salt: int) -> dict:
    """A schema with ``n`` properties (a slow compile), made new by ``salt``."""
    props = {f"field_{salt}_{i}": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": i}, "label": {"type": "string", "maxLength": 8},
        "kind": {"enum": [f"k{i}", f"j{i}", "other"]}}, "required": ["id", "kind"]}
        for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)[:n // 2]}


def compile_overlap(llm: LLM, batch: int, max_tokens: int, properties: int, salt: int) -> dict:
    """Free requests decode; a new big schema arrives: steps taken (and their times) while
    its request waits for its grammar."""
    from conveyor.request import RequestStatus

    engine = llm.engine
    grammars = engine.core.executor.runner.grammars
    sched = engine.core.scheduler
    for i in range(batch):
        engine.add_request(f"request {i}:", free(max_tokens, i), request_id=f"free{i}")
    for _ in range(2):  # the free batch is decoding
        engine.step()
    compiles_before = len(grammars.compile_s)
    waits_before = grammars.num_waits
    engine.add_request("the big one:", SamplingParams(
        temperature=1.0, max_tokens=8, seed=0,
        structured_outputs=StructuredOutputsParams(json=big_schema(properties, salt))),
        request_id="big")
    steps_ms, tokens_meanwhile = [], 0
    while "big" in sched.requests and \
            sched.requests["big"].status == RequestStatus.WAITING_FOR_GRAMMAR:
        before = sum(r.num_output_tokens for r in sched.requests.values())
        t0 = time.perf_counter()
        engine.step()
        steps_ms.append(1e3 * (time.perf_counter() - t0))
        after = sum(r.num_output_tokens for r in sched.requests.values())
        tokens_meanwhile += max(after - before, 0)
    while engine.has_unfinished_requests():
        engine.step()
    new = grammars.compile_s[compiles_before:]
    ordered = sorted(steps_ms)
    return {"schema_properties": properties, "compile_s": max(new) if new else None,
            "steps_while_waiting": len(steps_ms),
            "tokens_others_made_meanwhile": tokens_meanwhile,
            "step_ms_median_meanwhile": ordered[len(ordered) // 2] if ordered else None,
            "step_ms_max_meanwhile": ordered[-1] if ordered else None,
            "steps_that_waited_for_a_compile": grammars.num_waits - waits_before}


def throughput(llm: LLM, args: argparse.Namespace, report: dict) -> None:
    """The per-step costs at batch 1, 32 and 128, and the half-constrained rounds."""
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
    # The goal's figure: throughput lost with half the batch constrained (<= 5%), from
    # each round's pair (the two ran back to back), median over rounds.
    costs = sorted(1 - m["tokens_per_s"] / p["tokens_per_s"] for m, p in zip(mixed, plain))
    step_costs = sorted(m["step_ms"] / p["step_ms"] - 1 for m, p in zip(mixed, plain))
    report["throughput_cost_batch_32"] = costs[len(costs) // 2]
    report["step_ms_cost_batch_32"] = step_costs[len(step_costs) // 2]
    # Validity: the one-record schema, room to finish; every stopped output strict JSON.
    report["validity_batch_32"] = run(llm, [constrained(256, s, SCHEMA) for s in range(32)])
    # Step time is what throughput pays per token row; the constrained requests stop
    # when their JSON closes, so compare ms per step at the same batch, not tokens alone.


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--big-schema", type=int, default=400,
                    help="properties of compile_overlap's schema (0: skip that part)")
    ap.add_argument("--overlap-batch", type=int, default=32,
                    help="free requests decoding while compile_overlap's schema compiles")
    ap.add_argument("--only-compile-overlap", action="store_true",
                    help="skip the per-step costs and the throughput rounds")
    args = ap.parse_args()
    path = checkpoint(args.vocab, args.hidden, args.layers)
    llm = LLM(path, dtype="float32", num_threads=args.threads, max_num_seqs=128,
              max_num_batched_tokens=4096, num_kv_blocks=2048)
    grammars = llm.engine.core.executor.runner.grammars
    llm.generate(["warm"], constrained(args.max_tokens, 0), use_tqdm=False)  # tokenizer
    report: dict = {"model": f"llama hidden {args.hidden}, {args.layers} layers, vocab "
                             f"{args.vocab}", "threads": args.threads}
    if not args.only_compile_overlap:
        throughput(llm, args, report)
    if args.big_schema:
        report["compile_overlap"] = compile_overlap(
            llm, args.overlap_batch, 4 * args.max_tokens, args.big_schema, os.getpid())
    report["compile_s_max"] = max(grammars.compile_s) if grammars.compile_s else None
    report["compiles"] = len(grammars.compile_s)
    report["steps_that_waited_for_a_compile"] = grammars.num_waits
    report["step_wait_for_compile_s"] = grammars.wait_s
    print(json.dumps(report, indent=1))
    for batch in (1, 32, 128) if not args.only_compile_overlap else ():
        r = report[f"all_constrained_batch_{batch}"]
        print(f"batch {batch}, all constrained: mask apply + accept {r['grammar_ms_per_step']:.2f}"
              f" ms/step ({100 * r['grammar_share']:.1f}% of the step), fill "
              f"{r['mask_fill_ms_per_step']:.2f} ms/step beside the forward")
    if "compile_overlap" in report:
        c = report["compile_overlap"]
        print(f"a {c['schema_properties']}-property schema compiled in {c['compile_s']:.3f} s "
              f"while the others took {c['steps_while_waiting']} steps "
              f"({c['tokens_others_made_meanwhile']} tokens); steps that waited for a compile: "
              f"{report['steps_that_waited_for_a_compile']}")
    if not args.only_compile_overlap:
        print(f"batch 32, half constrained: {100 * report['throughput_cost_batch_32']:.1f}% "
              f"fewer tokens/s, {100 * report['step_ms_cost_batch_32']:.1f}% longer steps "
              "(goal <= 5%)")


if __name__ == "__main__":
    main()
