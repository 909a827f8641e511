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


def ideal_ratios(requests: list[BenchRequest], max_num_seqs: int,
                 costs: StepCosts | None = None) -> IdealRatios:
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
    return ideal


def measure_step_costs(engine_args: EngineArgs, batch_sizes: list[int], prompt_len: int, *,
                       steps: int = 8, warmup: int = 2) -> StepCosts:
    """Median decode-step time at each batch size, with contexts of ``prompt_len`` tokens,
    and the marginal time of a prompt token (one prefill of ``prompt_len`` tokens)."""
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.sampling_params import SamplingParams

    biggest = max(batch_sizes)
    # A budget that prefills every batch in one step, so the timed steps are pure decodes.
    engine = LLMEngine(dataclasses.replace(
        engine_args, batching="continuous", max_num_seqs=biggest,
        max_num_batched_tokens=max(engine_args.max_num_batched_tokens, biggest * prompt_len)))
    vocab = engine.config.model.vocab_size
    params = SamplingParams(max_tokens=1 + warmup + steps, ignore_eos=True, temperature=0.0,
                            detokenize=False)
    decode_s, prefill_1 = [], None
    for b in sorted(batch_sizes):
        for i in range(b):
            prompt = [16 + (7 * i + 13 * j + b) % (vocab - 16) for j in range(prompt_len)]
            engine.add_request(prompt, params)
        t = time.perf_counter()
        engine.step()  # the prefill of every request, each sampling its first token
        if b == 1:
            prefill_1 = time.perf_counter() - t
        times = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        decode_s.append(statistics.median(times[warmup:] or times))
    costs = StepCosts(sorted(batch_sizes), decode_s)
    if prefill_1 is not None and prompt_len > 1:
        costs.prefill_s_per_token = max(prefill_1 - costs.decode(1), 0.0) / (prompt_len - 1)
    return costs


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    """Every size up to 8, then powers of two and the cap (interpolated in between)."""
    sizes = set(range(1, min(max_num_seqs, 8) + 1))
    b = 16
    while b < max_num_seqs:
        sizes.add(b)
        b *= 2
    sizes.add(max_num_seqs)
    return sorted(sizes)
