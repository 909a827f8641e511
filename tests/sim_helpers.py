"""Shared by the simulator tests: small workload factories."""

from __future__ import annotations

import random

from conveyor.bench.workload import BenchRequest
from conveyor.config import EngineArgs

TICK = 2.0 ** -20  # times on this grid make sums of differences exact in floating point


def on_grid(t: float) -> float:
    return round(t / TICK) * TICK


def make_workload(n: int, *, seed: int = 0, vocab: int = 2048, mean_gap_s: float = 0.003,
                  prompt_range: tuple[int, int] = (8, 120), output_range: tuple[int, int] = (2, 24),
                  shared_prefix: int = 0, start: float = 0.0,
                  repeat_every: int = 7) -> list[BenchRequest]:
    """Poisson arrivals on the TICK grid; with ``shared_prefix`` every third prompt starts
    with one of two common prefixes of that many tokens, and every ``repeat_every``-th
    repeats the previous prompt exactly (0: never)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(4, vocab) for _ in range(shared_prefix)] for _ in range(2)]
    out, t, prev = [], start, None
    for i in range(n):
        t += rng.expovariate(1.0 / mean_gap_s) if mean_gap_s > 0 else 0.0
        length = rng.randint(*prompt_range)
        prompt = [rng.randrange(4, vocab) for _ in range(length)]
        if shared_prefix and i % 3 == 0:
            prompt = prefixes[i % 2] + prompt
        if prev is not None and repeat_every and i % repeat_every == repeat_every - 1:
            prompt = list(prev)
        prev = prompt
        out.append(BenchRequest(f"r{i}", on_grid(t), prompt, rng.randint(*output_range),
                            tenant=rng.choice(["a", "b"]), priority=rng.randint(0, 2),
                            slo_ttft_ms=rng.choice([None, 50.0, 200.0]),
                            slo_tpot_ms=rng.choice([None, 10.0, 40.0])))
    return out


def tiny_args(**overrides) -> EngineArgs:
    kw = dict(model="tiny", load_format="dummy", num_threads=1, block_size=16)
    kw.update(overrides)
    return EngineArgs(**kw)


class LinearCost:
    """A cost model with round numbers: ``per_step + per_token * tokens`` seconds."""

    cap_kv_to_useful = False

    def __init__(self, per_step: float = 0.01, per_token: float = 0.001,
                 kv_memory: int = 1 << 30) -> None:
        self.per_step = per_step
        self.per_token = per_token
        self.kv_memory = kv_memory

    def step_time(self, shape) -> float:
        return self.per_step + self.per_token * shape.num_tokens

    def kv_cache_memory(self, model) -> int:
        return self.kv_memory

    def describe(self) -> str:
        return f"linear {self.per_step}s + {self.per_token}s/token"
