"""What a new adapter's load costs the requests already running: step times of a decoding
base-model batch when a request naming a not-yet-loaded adapter arrives.

Each round: ``--batch`` base requests decode; after ``--warm-steps`` steps a request
naming a fresh adapter (rank ``--rank``, every projection, a new PEFT checkpoint each
round) is added; steps go on until all finish. Two modes, alternating round by round in
one process (the machine's load drifts): ``ahead`` (the engine: the core orders the load,
the runner reads it on its loader thread, the request runs once it is reported) and
``in-step`` (the scheduler told every adapter is ready, so the runner reads it inside the
step that first schedules its request: what the engine did before loads went ahead).
Reported per mode: the median step time, the time of the step that first schedules the
adapter's request (the running requests see it as one inter-token gap), and their ratio.

    PYTHONPATH=src python -m benchmarks.lora.adapter_load_stall --threads 2
    PYTHONPATH=src python -m benchmarks.lora.adapter_load_stall --shape 2048,5632,2 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from benchmarks.lora.lora_throughput import shaped_model, write_adapter
from conveyor import LoRARequest, SamplingParams
from conveyor.config import EngineArgs
from conveyor.config.presets import PRESETS
from conveyor.core import lora_loads
from conveyor.engine.llm_engine import LLMEngine


def one_round(eng: LLMEngine, lora: LoRARequest, batch: int, max_tokens: int,
              warm_steps: int, tag: str) -> tuple[float, float]:
    """(median step s, the step that first schedules the adapter's request, s)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.add_request([(7 * i + j) % 1000 + 3 for j in range(16)], params,
                        request_id=f"{tag}-base-{i}")
    times, first, steps = [], None, 0
    while eng.has_unfinished_requests():
        if steps == warm_steps:
            eng.add_request([5 + j for j in range(16)], SamplingParams(
                max_tokens=4, temperature=0.0, ignore_eos=True), request_id=f"{tag}-lora",
                lora_request=lora)
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0
        steps += 1
        req = eng.scheduler.requests.get(f"{tag}-lora")
        if first is None and req is not None and req.first_scheduled_time is not None:
            first = dt
        else:
            times.append(dt)
    assert first is not None, "the adapter's request never ran"
    return statistics.median(times), first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(PRESETS))
    ap.add_argument("--shape", default=None, metavar="HIDDEN,INTERMEDIATE,LAYERS")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--warm-steps", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="rounds per mode")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="conveyor-lora-stall-")
    model, cfg = (shaped_model(folder, args.shape) if args.shape
                  else (args.model, PRESETS[args.model]))
    eng = LLMEngine(EngineArgs(model=model, load_format="dummy", dtype="float32",
                               enable_lora=True, max_loras=2, max_cpu_loras=2,
                               max_lora_rank=args.rank, max_num_seqs=args.batch + 1,
                               num_threads=args.threads, enable_prefix_caching=False,
                               max_model_len=256))
    ready = lora_loads.LoRALoads.is_ready
    results: dict[str, list[tuple[float, float]]] = {"ahead": [], "in-step": []}
    one_round(eng, LoRARequest("warm", 999, write_adapter(folder, cfg, args.rank, 999)),
              args.batch, 8, 2, "warm")
    for k in range(args.rounds):
        for mode in ("in-step", "ahead") if k % 2 else ("ahead", "in-step"):
            lora_id = 1 + len(results["ahead"]) + len(results["in-step"])
            lora = LoRARequest(f"a{lora_id}", lora_id,
                               write_adapter(folder, cfg, args.rank, lora_id))
            lora_loads.LoRALoads.is_ready = (ready if mode == "ahead"
                                             else lambda self, request: True)
            try:
                results[mode].append(one_round(eng, lora, args.batch, args.max_tokens,
                                               args.warm_steps, f"{mode}-{k}"))
            finally:
                lora_loads.LoRALoads.is_ready = ready
    name = f"llama {args.shape}" if args.shape else args.model
    print(f"# {name}, {args.batch} base requests decoding, a rank-{args.rank} adapter's "
          f"request arrives; medians over {args.rounds} rounds per mode")
    print("| mode | median step ms | adapter's first step ms | first / median |")
    print("|---|---|---|---|")
    worst = {}
    for mode, rows in results.items():
        med = statistics.median(r[0] for r in rows)
        longest = statistics.median(r[1] for r in rows)
        worst[mode] = longest / med
        print(f"| {mode} | {med * 1e3:.1f} | {longest * 1e3:.1f} | {longest / med:.2f} |")
    print(f"the adapter's first step over the median, in-step / ahead: "
          f"{worst['in-step'] / worst['ahead']:.2f}x")


if __name__ == "__main__":
    main()
