"""One 2,048-token prefill step against its GEMM floor, with where the rest goes.

The engine (offline, SmolLM2-135M's shape, dummy weights) takes 2,048 prompt tokens in
one step: either the peers workload's mix (prompts uniform 32-256 tokens, so about 14
prompts a step) or one 2,048-token prompt. The step's wall time is set against
its **GEMM floor**: the same projections (the engine's own packed linears, whatever
backend the machine chose) called back to back on 2,048 rows, and the same shapes
through plain ``F.linear``. The breakdown times each part of the layer with perf_counter
around it (the projections, attention, the fused elementwise ops); what is left is
embedding, the LM head on the sampled rows, sampling and the engine's own work.

    python -m benchmarks.steps.prefill_step --dtype bfloat16
    python -m benchmarks.steps.prefill_step --dtype float32 --prompt one

``--gemm-against REV`` also times each round's step with git revision REV's ``gemm.c``
(the same engine, packed weights and prompts; the two alternate, one process) and prints
the ratio: a GEMM change's effect on a whole prefill step, drift hitting both alike.
"""

from __future__ import annotations

import argparse
import collections
import random
import resource
import statistics
import time

import torch
import torch.nn.functional as F

import conveyor.model.models.decoder as llama_module
from conveyor import LLM, SamplingParams
from conveyor.kernels.cpu.cpuinfo import cpu_model_name

TOKENS = 2048


def prompts(kind: str, rng: random.Random) -> list[list[int]]:
    if kind == "one":
        return [[rng.randrange(10, 40000) for _ in range(TOKENS)]]
    out, total = [], 0
    while total < TOKENS:
        n = min(rng.randint(32, 256), TOKENS - total)
        out.append([rng.randrange(10, 40000) for _ in range(n)])
        total += n
    return out


class Timers:
    """Seconds per part, from wrappers installed around the model's parts."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = collections.defaultdict(float)

    def wrap(self, name: str, fn):
        def timed(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            self.acc[name] += time.perf_counter() - t
            return r

        return timed


def install(model, timers: Timers) -> None:
    llama_module.paged_attention = timers.wrap("attention", llama_module.paged_attention)
    ops = model.ops
    for name in ("rms_norm", "add_rms_norm", "rope_", "silu_mul"):
        setattr(ops, name, timers.wrap(name, getattr(ops, name)))
    for layer in model.layers:
        for name, mod in (("qkv_proj", layer.self_attn.qkv_proj),
                          ("o_proj", layer.self_attn.o_proj),
                          ("gate_up_proj", layer.mlp.gate_up_proj),
                          ("down_proj", layer.mlp.down_proj)):
            mod.forward = timers.wrap(name, mod.forward)


def gemm_floor(model, dtype: torch.dtype, rounds: int) -> tuple[float, float]:
    """Seconds for every layer's projections on TOKENS rows: the engine's own linears,
    and plain F.linear on weights of the same shapes."""
    mods = [(mod, mod.in_features) for layer in model.layers
            for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                        layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    xs = {n: torch.randn(TOKENS, n).to(dtype) for n in {n for _, n in mods}}
    plain = [(torch.randn(m.out_features, n).to(dtype) * 0.02, n) for m, n in mods]

    def own() -> None:
        for mod, n in mods:
            mod(xs[n])

    def flinear() -> None:
        for w, n in plain:
            F.linear(xs[n], w)

    out = []
    for fn in (own, flinear):
        fn()
        ts = []
        for _ in range(rounds):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        out.append(statistics.median(ts))
    return out[0], out[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--prompt", default="mix", choices=("mix", "one"),
                   help="mix: prompts of 32-256 tokens; one: a single 2,048-token prompt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--linear-backend", default="auto")
    p.add_argument("--gemm-against", metavar="REV",
                   help="also time each step with git revision REV's gemm.c")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    llm = LLM("smollm2-135m", dtype=args.dtype, max_num_seqs=128,
              max_num_batched_tokens=TOKENS, load_format="dummy",
              enable_prefix_caching=False, attention_backend=args.attention_backend,
              linear_backend=args.linear_backend)
    engine = llm.engine
    model = engine.runner.model
    rng = random.Random(0)
    timers = Timers()
    faults: list[int] = []
    system: list[float] = []

    def one_step(tag: str, batch: list[list[int]], record: bool = True) -> float:
        for i, ids in enumerate(batch):
            engine.add_request({"prompt_token_ids": ids},
                               SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0),
                               request_id=f"{tag}-{i}")
        timers.acc.clear()
        before = resource.getrusage(resource.RUSAGE_SELF)
        t = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_SELF)
        if record:
            faults.append(after.ru_minflt - before.ru_minflt)
            system.append(after.ru_stime - before.ru_stime)
        while engine.has_unfinished_requests():
            engine.step()
        return wall

    one_step("warmup", prompts(args.prompt, rng))
    gemms = None
    if args.gemm_against:
        from benchmarks.common import gemm_at
        from conveyor.kernels.cpu import ops

        gemms = (ops._lib or ops._native(), gemm_at(args.gemm_against))

    def step_against(tag: str, batch: list[list[int]]) -> float:
        """One step with REV's GEMM (not recorded), this tree's restored after."""
        ops._lib = gemms[1]
        try:
            return one_step(tag, batch, record=False)
        finally:
            ops._lib = gemms[0]

    if gemms is not None:
        step_against("warmup-against", prompts(args.prompt, rng))
    install(model, timers)
    walls, parts, against = [], [], []
    for r in range(args.rounds):
        batch = prompts(args.prompt, rng)  # both GEMMs' steps of a round take the same
        if gemms is not None and r % 2 == 0:  # REV's first in even rounds, after in odd
            other = step_against(f"a{r}", batch)
        walls.append(one_step(f"r{r}", batch))
        parts.append(dict(timers.acc))
        if gemms is not None and r % 2 == 1:
            other = step_against(f"a{r}", batch)
        if gemms is not None:
            against.append(other / walls[-1])
            print(f"round {r}: step {walls[-1] * 1e3:.0f} ms, with {args.gemm_against}'s "
                  f"GEMM {other * 1e3:.0f} ms: {against[-1]:.3f}x", flush=True)
    own, flinear = gemm_floor(model, dtype, args.rounds)
    wall = statistics.median(walls)
    med = {k: statistics.median(p.get(k, 0.0) for p in parts) for k in parts[0]}
    print(f"CPU: {cpu_model_name()}, {args.dtype}, {args.threads} threads, {TOKENS} prompt "
          f"tokens in one step ({args.prompt}), median of {args.rounds}")
    print(f"steps: {', '.join(f'{w * 1e3:.0f}' for w in walls)} ms; page faults "
          f"{', '.join(map(str, faults[1:]))}, system time "
          f"{', '.join(f'{s * 1e3:.0f}' for s in system[1:])} ms")
    print(f"step {wall * 1e3:8.1f} ms   GEMM floor: engine's linears {own * 1e3:.1f} ms "
          f"({wall / own:.2f}x), F.linear {flinear * 1e3:.1f} ms ({wall / flinear:.2f}x)")
    if against:
        print(f"median ratio step with {args.gemm_against}'s GEMM / this tree's: "
              f"{statistics.median(against):.3f}")
    for name, s in sorted(med.items(), key=lambda kv: -kv[1]):
        print(f"  {name:14s} {s * 1e3:8.1f} ms  {100 * s / wall:5.1f}%")
    print(f"  {'rest':14s} {(wall - sum(med.values())) * 1e3:8.1f} ms  (embedding, LM head, "
          "sampling, the engine)")


if __name__ == "__main__":
    main()
