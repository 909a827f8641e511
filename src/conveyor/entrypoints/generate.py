"""``conveyor generate``: run prompts offline and print the text and throughput."""

from __future__ import annotations

import argparse
import json
import time

from conveyor.config import EngineArgs

DEFAULT_PROMPTS = [
    "The quick brown fox",
    "Once upon a time",
    "In a distant galaxy",
    "The meaning of life is",
]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate offline for a few prompts",
                       description="Generate for prompts with the offline engine and print "
                                   "the outputs and tokens/s. With no --model, a tiny "
                                   "dummy-weight model is used.")
    EngineArgs.add_cli_args(p)
    p.add_argument("--prompt", action="append", default=None,
                   help="a prompt (repeatable); default: four built-in prompts")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="repeat the prompts to this many requests")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object per output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from conveyor.entrypoints.llm import LLM
    from conveyor.sampling_params import SamplingParams

    engine_args = EngineArgs.from_cli_args(args)
    t0 = time.perf_counter()
    llm = LLM(**vars(engine_args))
    load_s = time.perf_counter() - t0
    prompts = args.prompt or DEFAULT_PROMPTS
    if args.num_prompts:
        prompts = [prompts[i % len(prompts)] for i in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, ignore_eos=args.ignore_eos,
                            seed=args.seed if args.temperature > 0 else None)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    for o in outs:
        c = o.outputs[0]
        if args.json:
            print(json.dumps({"prompt": o.prompt, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason}))
        else:
            print(f"{o.prompt!r} -> {c.text!r} ({len(c.token_ids)} tokens, {c.finish_reason})")
    stats = llm.stats()
    print(f"model {engine_args.model} ({llm.engine.config.model.dtype_label}, "
          f"{llm.engine.config.device}) loaded in {load_s:.1f}s; {len(outs)} requests, "
          f"{generated} tokens in {elapsed:.2f}s: {generated / elapsed:.1f} generated tokens/s, "
          f"{stats['num_steps']} steps, {stats['num_preemptions']} preemptions")
    return 0
