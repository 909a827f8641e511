"""What continuous batching can gain over static batching on a given sample, on paper.

Both schedules are replayed with ``max_num_seqs`` slots, FCFS, one token per running
request per step (a request's first token comes with its prefill step):

    static:      batches of S requests; a batch steps until its longest member ends,
                 its finished members idle in their slots
    continuous:  a finished request's slot is refilled at the next step

The *slot ideal* is the ratio of the two step counts (right when a step costs the same
at any batch size). The *cost ideal* weighs every step with the time a decode step of
that batch size takes, measured on this machine first (``measure_step_costs``): on a
CPU a bigger batch costs more, so packing slots gains less. ``with_prefill`` adds the
measured prompt-token cost, the same for both schedules.
"""

from __future__ import annotations

import bisect
import dataclasses
import statistics
import time
from collections import deque
from dataclasses import dataclass

from conveyor.bench.workload import BenchRequest
from conveyor.config import EngineArgs


def static_schedule(output_lens: list[int], max_num_seqs: int) -> list[int]:
    """Requests computed in each step of static batching."""
    sizes = []
    for start in range(0, len(output_lens), max_num_seqs):
        batch = output_lens[start:start + max_num_seqs]
        sizes.extend(sum(1 for n in batch if n > k) for k in range(max(batch)))
    return sizes


def continuous_schedule(output_lens: list[int], max_num_seqs: int) -> list[int]:
    """Requests computed in each step of continuous batching (slots refilled every step)."""
    queue = deque(output_lens)
    running: list[int] = []
    sizes = []
    while queue or running:
        while queue and len(running) < max_num_seqs:
            running.append(queue.popleft())
        sizes.append(len(running))
        running = [n - 1 for n in running if n > 1]
    return sizes


@dataclass
class StepCosts:
    """Measured seconds of one decode step per batch size, and of one prompt token."""

    batch_sizes: list[int]
    decode_s: list[float]
    prefill_s_per_token: float = 0.0

    def decode(self, batch: int) -> float:
        """Linear interpolation between measured sizes (extrapolated past the ends)."""
        xs, ys = self.batch_sizes, self.decode_s
        if len(xs) == 1:
            return ys[0]
        i = min(max(bisect.bisect_left(xs, batch), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(y0 + (y1 - y0) * (batch - x0) / (x1 - x0), 0.0)

    @classmethod
    def from_step_trace(cls, trace: list[tuple[int, int, float]]) -> StepCosts | None:
        """Median time of the pure decode steps (one token per request) per batch size,
        from runs' own step traces: the cost curve under the runs' very conditions."""
        by_size: dict[int, list[float]] = {}
        for requests, tokens, seconds in trace:
            if tokens == requests:
                by_size.setdefault(requests, []).append(seconds)
        if not by_size:
            return None
        sizes = sorted(by_size)
        return cls(sizes, [statistics.median(by_size[b]) for b in sizes])


@dataclass
class IdealRatios:
    """Continuous over static throughput that a perfect implementation would reach."""

    static_steps: int
    continuous_steps: int
    useful_tokens: int
    max_num_seqs: int
    slot_ideal: float  # static steps / continuous steps
    packing_bound: float  # static slot-steps / useful tokens (continuous never idles a slot)
    cost_ideal: float | None = None  # decode steps weighted by measured step time
    cost_ideal_with_prefill: float | None = None
    # Weighted instead by the decode steps' times seen in the runs themselves.
    cost_ideal_in_run: float | None = None


def ideal_ratios(requests: list[BenchRequest], max_num_seqs: int,
                 costs: StepCosts | None = None,
                 run_costs: StepCosts | None = None) -> IdealRatios:
    lens = [r.output_len for r in requests]  # FCFS order: requests are in arrival order
    static = static_schedule(lens, max_num_seqs)
    cont = continuous_schedule(lens, max_num_seqs)
    useful = sum(lens)
    ideal = IdealRatios(len(static), len(cont), useful, max_num_seqs,
                        slot_ideal=len(static) / len(cont),
                        packing_bound=len(static) * max_num_seqs / useful)
    if costs is not None:
        t_static = sum(costs.decode(b) for b in static)
        t_cont = sum(costs.decode(b) for b in cont)
        prefill = costs.prefill_s_per_token * sum(r.prompt_len for r in requests)
        ideal.cost_ideal = t_static / t_cont
        ideal.cost_ideal_with_prefill = (t_static + prefill) / (t_cont + prefill)
    if run_costs is not None:
        ideal.cost_ideal_in_run = (sum(run_costs.decode(b) for b in static)
                                   / sum(run_costs.decode(b) for b in cont))
    return ideal


def measure_step_costs(engine_args: EngineArgs, batch_sizes: list[int], context_len: int, *,
                       steps: int = 6, warmup: int = 2, passes: int = 2) -> StepCosts:
    """Median decode-step time at each batch size with contexts of ``context_len`` tokens,
    and the marginal time of a prompt token (from the prefill of a single request).

    The sizes are measured in ``passes`` interleaved sweeps, so a burst of load from
    elsewhere on the machine spreads over all sizes instead of skewing one.
    """
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.sampling_params import SamplingParams

    sizes = sorted(set(batch_sizes))
    biggest = sizes[-1]
    # A budget that prefills every batch in one step, so the timed steps are pure decodes.
    engine = LLMEngine(dataclasses.replace(
        engine_args, batching="continuous", max_num_seqs=biggest,
        max_num_batched_tokens=max(engine_args.max_num_batched_tokens,
                                   biggest * context_len)))
    vocab = engine.config.model.vocab_size
    params = SamplingParams(max_tokens=1 + warmup + steps, ignore_eos=True, temperature=0.0,
                            detokenize=False)
    samples: dict[int, list[float]] = {b: [] for b in sizes}
    prefill_1: list[float] = []
    for p in range(passes):
        for b in sizes if p % 2 == 0 else sizes[::-1]:
            for i in range(b):
                engine.add_request([16 + (7 * i + 13 * j + 31 * p + b) % (vocab - 16)
                                    for j in range(context_len)], params)
            t = time.perf_counter()
            engine.step()  # the prefill of every request, each sampling its first token
            if b == 1:
                prefill_1.append(time.perf_counter() - t)
            times = []
            while engine.has_unfinished_requests():
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            samples[b].extend(times[warmup:] or times)
    costs = StepCosts(sizes, [statistics.median(samples[b]) for b in sizes])
    if prefill_1 and context_len > 1:
        extra = statistics.median(prefill_1) - costs.decode(1)
        costs.prefill_s_per_token = max(extra, 0.0) / (context_len - 1)
    return costs


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two below the cap, and the cap (interpolated in between)."""
    sizes = {max_num_seqs}
    b = 1
    while b < max_num_seqs:
        sizes.add(b)
        b *= 2
    return sorted(sizes)
