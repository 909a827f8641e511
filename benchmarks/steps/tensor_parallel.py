"""Tensor parallelism on this machine: TP=2 against TP=1 step times, and what the
all-reduces cost.

    python -m benchmarks.steps.tensor_parallel --quick   # tiny + qwen3-0.6b, ~2-3 minutes
    python -m benchmarks.steps.tensor_parallel --model qwen3-0.6b --batch-sizes 1 8 32 \\
        --prefill 512 --steps 20

TP=1 runs twice, on every core (``--num-threads``) and on half of them; TP=2 runs two
gloo ranks with half each (the default split). Weights are dummy (``load_format
dummy``): step times do not depend on their values. For each batch size: the median
decode step (every request one token) and the median prefill step of one
``--prefill``-token prompt, through ``LLMEngine.step`` (scheduling, the broadcast, the
model, sampling). Then, on two gloo processes of one thread each, the median time of
one ``all_reduce`` of a ``[rows, hidden]`` float32 tensor (what each o_proj and
down_proj output costs: two per layer, plus one for the embedding) and of the LM head's
``all_gather`` of ``[rows, vocab / 2]`` logits, and the step's total of them; and an
empty step's executor round trip (under TP: the broadcast and every rank's reply). No
speed-up is expected on a 2-core CPU: the two ranks split the same two cores TP=1
already uses, and add the collectives and a process hop per step.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time

from conveyor.config import EngineArgs
from conveyor.engine.llm_engine import LLMEngine
from conveyor.kernels.cpu.cpuinfo import cpu_model_name
from conveyor.sampling_params import SamplingParams


def engine_for(model: str, tp: int, threads: int, max_seqs: int, budget: int) -> LLMEngine:
    return LLMEngine(EngineArgs(
        model=model, load_format="dummy", dtype="float32", tensor_parallel_size=tp,
        num_threads=threads, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
        max_model_len=2048, enable_prefix_caching=False, warmup=True))


def _prompt(n: int, salt: int, vocab: int) -> list[int]:
    return [(7 + 31 * i + 1009 * salt) % (vocab - 10) + 5 for i in range(n)]


def timed_step(engine: LLMEngine) -> float:
    t = time.perf_counter()
    engine.step()
    return time.perf_counter() - t


def decode_step_s(engine: LLMEngine, batch: int, steps: int, salt: int) -> float:
    vocab = engine.config.model.vocab_size
    ids = [f"d{salt}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request({"prompt_token_ids": _prompt(16, salt * 1000 + i, vocab)},
                           SamplingParams(max_tokens=steps + 4, ignore_eos=True,
                                          temperature=0.0), request_id=rid)
    while engine.scheduler.num_waiting or any(  # until every request decodes
            r.num_computed_tokens < r.num_prompt_tokens
            for r in engine.scheduler.requests.values()):
        engine.step()
    times = [timed_step(engine) for _ in range(steps)]
    engine.abort_request(ids)
    return statistics.median(times)


def prefill_step_s(engine: LLMEngine, tokens: int, repeats: int, salt: int) -> float:
    vocab = engine.config.model.vocab_size
    times = []
    for r in range(repeats):
        rid = f"p{salt}-{r}"
        engine.add_request({"prompt_token_ids": _prompt(tokens, salt * 100 + r, vocab)},
                           SamplingParams(max_tokens=1, temperature=0.0), request_id=rid)
        times.append(timed_step(engine))  # the budget holds the whole prompt
        while engine.has_unfinished_requests():
            engine.step()
    return statistics.median(times)


def sides(threads: int) -> dict[str, tuple[int, int]]:
    """Label -> (tensor_parallel_size, num_threads): TP=1 on every core, TP=1 on one
    rank's share of them (the per-core comparison), TP=2."""
    half = max(1, threads // 2)
    out = {f"TP=1 x{threads} threads": (1, threads)}
    if half != threads:
        out[f"TP=1 x{half} threads"] = (1, half)
    out[f"TP=2 x{half} threads/rank"] = (2, threads)
    return out


def empty_step_s(engine: LLMEngine, repeats: int) -> float:
    """The executor's round trip for a step with nothing scheduled: under TP the
    broadcast to every rank and their replies, no model (the process hop's cost)."""
    from conveyor.core.scheduler_output import SchedulerOutput

    executor = engine.core.executor
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        executor.execute_model(SchedulerOutput())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def step_table(model: str, batches: list[int], prefill: int, steps: int,
               threads: int) -> dict:
    out: dict = {}
    for label, (tp, n) in sides(threads).items():
        engine = engine_for(model, tp, n, max(batches), max(prefill, max(batches)))
        row = {f"decode_b{b}_ms": 1e3 * decode_step_s(engine, b, steps, i)
               for i, b in enumerate(batches)}
        row[f"prefill_{prefill}_ms"] = 1e3 * prefill_step_s(engine, prefill, 3, 7)
        row["empty_step_ms"] = 1e3 * empty_step_s(engine, 4 * steps)
        out[label] = row
        engine.shutdown()
    return out


def _collective_rank(rank: int, port: int, hidden: int, vocab_shard: int,
                     reduce_rows: list[int], gather_rows: list[int], iters: int,
                     queue) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=60))

    def median_us(fn) -> float:
        for _ in range(5):
            fn()
        times = []
        for _ in range(iters):
            dist.barrier()  # both ranks start together: the time is the collective's
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return 1e6 * statistics.median(times)

    res = {}
    for n in reduce_rows:
        x = torch.randn(n, hidden)
        res[f"all_reduce_{n}"] = median_us(lambda x=x: dist.all_reduce(x))
    for n in gather_rows:
        parts = [torch.empty(n, vocab_shard) for _ in range(2)]
        logits = torch.randn(n, vocab_shard)
        res[f"all_gather_{n}"] = median_us(lambda p=parts, v=logits: dist.all_gather(p, v))
    if rank == 0:
        queue.put(res)
    dist.destroy_process_group()


def collectives(hidden: int, vocab: int, reduce_rows: list[int], gather_rows: list[int],
                iters: int) -> dict:
    from conveyor.executor.tp_worker import free_port

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_collective_rank,
                         args=(r, port, hidden, -(-vocab // 2), reduce_rows, gather_rows,
                               iters, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    res = queue.get(timeout=600)
    for p in procs:
        p.join(30)
    return res


def model_shape(model: str) -> tuple[int, int, int]:
    cfg = EngineArgs(model=model, load_format="dummy").resolve_model()
    return cfg.hidden_size, cfg.vocab_size, cfg.num_layers


def run(model: str, batches: list[int], prefill: int, steps: int, threads: int,
        iters: int) -> dict:
    hidden, vocab, layers = model_shape(model)
    steps_ms = step_table(model, batches, prefill, steps, threads)
    # A decode step's LM head gathers a row per request; a prefill step's, the one
    # sampling row of its prompt.
    gather_of = {**{b: b for b in batches}, prefill: 1}
    coll = collectives(hidden, vocab, list(gather_of), sorted(set(gather_of.values())), iters)
    per_step = {}
    for n, g in gather_of.items():
        reduce_us, gather_us = coll[f"all_reduce_{n}"], coll[f"all_gather_{g}"]
        per_step[n] = {"all_reduce_us": reduce_us, "all_gather_logits_us": gather_us,
                       "gather_rows": g,
                       # 2 per layer (o_proj, down_proj) + the embedding's + the gather.
                       "step_collectives_ms": ((2 * layers + 1) * reduce_us
                                               + gather_us) / 1e3}
    return {"model": model, "hidden": hidden, "vocab": vocab, "layers": layers,
            "steps_ms": steps_ms, "collectives": per_step}


def print_report(res: dict, batches: list[int], prefill: int) -> None:
    print(f"\n## {res['model']} (hidden {res['hidden']}, {res['layers']} layers, "
          f"vocab {res['vocab']})")
    labels = list(res["steps_ms"])
    print("| step (median ms) | " + " | ".join(labels) + " |")
    print("|---" * (len(labels) + 1) + "|")
    keys = [f"decode_b{b}_ms" for b in batches] + [f"prefill_{prefill}_ms", "empty_step_ms"]
    for k in keys:
        cells = " | ".join(f"{res['steps_ms'][label][k]:.2f}" for label in labels)
        print(f"| {k.removesuffix('_ms')} | {cells} |")
    print(f"\n| step rows | one all_reduce of [rows, {res['hidden']}] us | LM-head "
          f"all_gather us (rows) | {2 * res['layers'] + 1} all_reduces + gather, ms |")
    print("|---|---|---|---|")
    for n, c in res["collectives"].items():
        print(f"| {n} | {c['all_reduce_us']:.1f} | {c['all_gather_logits_us']:.1f} "
              f"({c['gather_rows']}) | {c['step_collectives_ms']:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=None,
                   help="a preset shape (repeatable); default tiny and qwen3-0.6b")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--iters", type=int, default=200, help="timed collectives per shape")
    p.add_argument("--num-threads", type=int, default=os.cpu_count())
    p.add_argument("--quick", action="store_true",
                   help="fewer steps and shapes (a couple of minutes)")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args()
    os.environ.setdefault("CONVEYOR_MEASURE_LINEARS", "0")  # same backends both sides
    models = args.model or ["tiny", "qwen3-0.6b"]
    batches, prefill, steps, iters = args.batch_sizes, args.prefill, args.steps, args.iters
    if args.quick:
        batches, prefill, steps, iters = [1, 8], 256, 6, 50
    cpu = cpu_model_name()
    print(f"CPU: {cpu} ({os.cpu_count()} cores); TP=1 {args.num_threads} threads, TP=2 "
          f"{max(1, args.num_threads // 2)} per rank; float32, dummy weights")
    results = []
    for model in models:
        res = run(model, batches, prefill, steps, args.num_threads, iters)
        print_report(res, batches, prefill)
        results.append(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "argv": sys.argv[1:], "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
