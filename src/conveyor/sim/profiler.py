"""Measure real engine step times over a grid of batch shapes (imports torch).

The real ``LLMEngine`` (model runner, scheduler, output processing) runs small
synthetic workloads chosen to produce the shapes of the grid:

- decode: ``b`` requests of ``c`` prompt tokens each, for every batch size ``b`` and
  context length ``c``: their prefill chunks (with the first ones already decoding
  alongside), then ``decode_steps`` decode steps of batch ``b`` at context ~``c``;
- prefill: one request of ``p`` prompt tokens for every ``p`` (one prefill step);
- mixed: a prefill of ``p`` tokens arriving while ``b`` requests decode;
- continued: a prompt of ``c + p`` tokens after one of its first ``c`` (for every ``c``
  and the two smallest ``p``): with prefix caching its prefill computes ``p`` tokens
  that gather ``c`` cached ones, as a prefix-cache hit or a prompt's later chunk does.

Each ``engine.step()`` is timed whole (schedule, forward, sampling, update, output
processing): that is the step period the simulator advances its clock by. A
``StepRecorder`` pairs each time with the step's batch shape.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.config import EngineArgs
from conveyor.costs.profile import ProfileCostModel, fit_step_times
from conveyor.costs.shape import BatchShape
from conveyor.sampling_params import SamplingParams
from conveyor.sim.recorder import StepRecorder


@dataclass(frozen=True)
class ProfileGrid:
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    context_lens: tuple[int, ...] = (32, 128, 512)
    prefill_tokens: tuple[int, ...] = (16, 64, 128, 256, 512)
    decode_steps: int = 6
    repeats: int = 3

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "context_lens", "prefill_tokens"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"profile grid {name} must be positive integers, got {values}")
        if self.decode_steps < 1 or self.repeats < 1:
            raise ValueError("decode_steps and repeats must be >= 1")


Item = tuple[int, int] | tuple[int, int, int]


def _workloads(grid: ProfileGrid, budget: int) -> list[tuple[str, list[Item], list[Item]]]:
    """(label, requests at once, requests added later); a request is (prompt_len,
    output_len) or (prompt_len, output_len, leading tokens shared with the workload's
    other requests)."""
    out = []
    for c in grid.context_lens:
        for b in grid.batch_sizes:
            # Prefills take ceil(b*c / budget) steps (decoding alongside); the output is long
            # enough that all b then decode together for decode_steps steps.
            prefill_steps = -(-b * c // budget)
            out.append((f"decode b={b} ctx={c}",
                        [(c, grid.decode_steps + prefill_steps + 1)] * b, []))
    for p in grid.prefill_tokens:
        if p <= budget:
            out.append((f"prefill p={p}", [(p, 1)], []))
    for b in (grid.batch_sizes[len(grid.batch_sizes) // 2], max(grid.batch_sizes)):
        for p in grid.prefill_tokens[1::2]:
            out.append((f"mixed b={b} p={p}", [(min(grid.context_lens), 8)] * b, [(p, 2)]))
    for c in grid.context_lens:
        for p in sorted(grid.prefill_tokens)[:2]:
            if p <= budget:
                out.append((f"continued c={c} p={p}", [(c, 1, c)], [(c + p, 1, c)]))
    return out


def profile_steps(args: EngineArgs, grid: ProfileGrid,
                  log: Callable[[str], None] | None = None,
                  timer: Callable[[], float] = time.perf_counter
                  ) -> tuple[list[tuple[BatchShape, float]], object]:
    """Run the grid on the real engine; returns ((shape, seconds) per step, the engine).

    ``timer`` times each step: wall time by default; ``time.process_time`` counts only
    this process's CPU time, which other processes on a busy machine do not inflate.
    """
    from conveyor.engine.llm_engine import LLMEngine

    log = log or (lambda msg: print(msg, file=sys.stderr))
    need_seqs = max(grid.batch_sizes) + 1
    args = dataclasses.replace(args, max_num_seqs=max(args.max_num_seqs, need_seqs))
    engine = LLMEngine(args)
    vocab = engine.config.model.vocab_size
    budget = args.max_num_batched_tokens
    rng = random.Random(args.seed)
    recorder = StepRecorder(engine.scheduler)
    samples: list[tuple[BatchShape, float]] = []

    def add(prompt_len: int, output_len: int, shared: int, prefix: list[int]) -> None:
        prompt = prefix[:shared] + [rng.randrange(4, vocab) for _ in range(prompt_len - shared)]
        engine.add_request(prompt, SamplingParams(max_tokens=output_len, temperature=0.0,
                                                  ignore_eos=True))

    def run(label: str, first: list[Item], later: list[Item], keep: bool) -> None:
        # Fresh for every run: a repeat must not hit an earlier repeat's cached prefix.
        prefix = [rng.randrange(4, vocab) for _ in range(max(i[0] for i in first + later))]
        for p, o, *shared in first:
            add(p, o, sum(shared), prefix)
        pending = list(later)
        while engine.has_unfinished_requests():
            before = len(recorder.records)
            t0 = timer()
            engine.step()
            elapsed = timer() - t0
            if keep and len(recorder.records) > before:
                samples.append((recorder.records[-1].shape, elapsed))
            if pending and engine.scheduler.num_waiting == 0 and all(
                    r.num_computed_tokens >= r.num_prompt_tokens
                    for r in engine.scheduler.running):
                for p, o, *shared in pending:  # arrive once every request is decoding
                    add(p, o, sum(shared), prefix)
                pending = []

    workloads = _workloads(grid, budget)
    # Warm up (allocator, kernels, lazy init) on a few shapes; those times are dropped.
    for label, first, later in workloads[:3]:
        run(label, first, later, keep=False)
    for rep in range(grid.repeats):
        for label, first, later in workloads:
            t0 = time.perf_counter()
            n0 = len(samples)
            run(label, first, later, keep=True)
            log(f"[{rep + 1}/{grid.repeats}] {label}: {len(samples) - n0} steps "
                f"in {time.perf_counter() - t0:.2f}s")
    recorder.detach()
    return samples, engine


def build_profile(args: EngineArgs, grid: ProfileGrid,
                  log: Callable[[str], None] | None = None,
                  timer: Callable[[], float] = time.perf_counter
                  ) -> tuple[ProfileCostModel, list[tuple[BatchShape, float]]]:
    import platform

    import torch

    from conveyor.model.attention.native_decode import NativeDecode
    from conveyor.runner.model_runner import default_kv_cache_memory

    samples, engine = profile_steps(args, grid, log, timer)
    # The native CPU kernel reads each decode row's own context; SDPA pads to the longest.
    kernel = engine.runner.decode_kernel
    layout = "paged" if isinstance(kernel, NativeDecode) else "padded"
    fit = fit_step_times([s for s, _ in samples], [t for _, t in samples], layout)
    cfg = engine.config
    device = torch.device(cfg.device)
    meta = {"machine": platform.machine(), "processor": platform.processor(),
            "cpu_count": __import__("os").cpu_count(), "torch": torch.__version__,
            "num_threads": torch.get_num_threads(),
            "timer": getattr(timer, "__name__", str(timer)),
            "decode_kernel": type(kernel).__name__ if isinstance(kernel, NativeDecode)
            else getattr(kernel, "__name__", str(kernel)), "block_size": cfg.cache.block_size,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "enable_prefix_caching": cfg.cache.enable_prefix_caching,
            "grid": dataclasses.asdict(grid)}
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    model = ProfileCostModel.model_fields(cfg.model, args.model)
    profile = ProfileCostModel(fit, model=model, device=device.type,
                               kv_cache_memory=default_kv_cache_memory(device), meta=meta)
    return profile, samples
