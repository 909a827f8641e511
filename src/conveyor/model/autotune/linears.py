"""Linear backends chosen by measurement, per weight shape, on the machine at hand.

Kernels tuned to one CPU lose on the next, so ``linear_backend="auto"`` times every
candidate that supports the model (the registered linear backends) on each of the
model's own weight shapes, at a decode row count (``max_num_seqs``) and a prefill one
(the token budget, capped), and packs each projection with the fastest. Decode rows are
timed as a decode step runs them: over a copy of every projection of the model in layer
order (up to ``ROTATION_BYTES``), so each call reads its weight from memory, not from a
cache the call before it warmed (timed warm, a backend that streams a cold weight slowly
looks faster than it runs). A backend's loss is its decode time over the best one's plus
its prefill time over the best one's (``fastest``): both regimes count alike. Backends
take turns, ``MEASURE_ROUNDS`` of them in alternating order, each keeping its best: on a
shared machine one noisy turn would otherwise decide a choice that is then cached. The
choice is cached per CPU model, flags, torch version, thread count, dtype, shapes, row
counts and native kernel build (``<cache>/linear_choice.json``), logged, and
``--linear-backend NAME`` still forces one; ``CONVEYOR_MEASURE_LINEARS=0`` keeps the
static priority order.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from conveyor import envs
from conveyor.kernels.cpu.cpuinfo import cpu_model_name
from conveyor.model.autotune import cache as choice_cache
from conveyor.model.linear.shape import LinearShape

logger = logging.getLogger(__name__)

PREFILL_ROWS_CAP = 512  # enough rows to be compute-bound; keeps the measurement short
# The decode measurement's working set at most: past a CPU's last-level cache share, and
# no more packing than that per backend.
ROTATION_BYTES = 64 << 20
ROTATION_PASSES = 3  # timed passes over the rotation (the fastest is kept)
MEASURE_ROUNDS = 2  # turns of every backend, in alternating order (the best is kept)


def measuring_enabled() -> bool:
    return envs.switched_on(envs.MEASURE_LINEARS)


def rotation(shapes: list[LinearShape], counts: dict[str, int] | None, itemsize: int,
             cap: int = ROTATION_BYTES) -> list[LinearShape]:
    """The decode measurement's calls in order: a layer's shapes, layer after layer (each
    shape as often as the model has it, ``counts`` by key, 1 if absent), until ``cap``
    bytes of weights (at least one round)."""
    counts = counts or {}
    rounds = max((counts.get(s.key, 1) for s in shapes), default=0)
    order: list[LinearShape] = []
    total = 0
    for i in range(rounds):
        for s in shapes:
            if i < counts.get(s.key, 1):
                order.append(s)
                total += s.out_features * s.in_features * itemsize
        if total >= cap:
            break
    return order


def _cache_key(shapes: list[LinearShape], dtype: torch.dtype, rows: tuple[int, int],
               candidates: list[str], counts: dict[str, int] | None) -> str:
    # ("rotation": decode rows timed over the model's weights; a choice timed warm, as
    # before, is not reused)
    return choice_cache.key(str(dtype), repr(rows), ",".join(candidates),
                            ",".join(f"{s.key}*{(counts or {}).get(s.key, 1)}"
                                     for s in shapes), "rotation",
                            choice_cache.kernel_build())


def _forward(module: nn.Module, shape: LinearShape):
    if shape.gate_up and not getattr(module, "applies_silu_mul", False):
        half = shape.out_features // 2

        def run(x: torch.Tensor) -> torch.Tensor:
            y = module(x)
            return F.silu(y[:, :half]) * y[:, half:]

        return run
    return module


@torch.inference_mode()
def measure(shapes: list[LinearShape], backends: dict[str, object], device: torch.device,
            dtype: torch.dtype, decode_rows: int, prefill_rows: int,
            counts: dict[str, int] | None = None
            ) -> dict[str, dict[str, tuple[float, float]]]:
    """(decode, prefill) seconds per (shape key, backend name): a decode-sized call timed
    in the rotation (``rotation``: ``counts`` is how many weights of each shape the model
    has) and a prefill-sized one (the LM head, which runs on sampled rows only, or prefill
    rows no more than decode ones: the decode call's time again)."""
    gen = torch.Generator().manual_seed(0)
    # bf16 values, so that a backend which takes only those (native-bf16) can be timed
    weights = {s.key: (torch.randn(s.out_features, s.in_features, generator=gen) * 0.02).to(
        torch.bfloat16).to(device=device, dtype=dtype) for s in shapes}
    order = rotation(shapes, counts, dtype.itemsize)
    decode_x = {s.key: torch.randn(decode_rows, s.in_features, generator=gen).to(
        device=device, dtype=dtype) for s in shapes}
    prefill_x = {s.key: torch.randn(prefill_rows, s.in_features, generator=gen).to(
        device=device, dtype=dtype) for s in shapes
        if not (s.lm_head or prefill_rows <= decode_rows)}
    out: dict[str, dict[str, tuple[float, float]]] = {s.key: {} for s in shapes}
    # MEASURE_ROUNDS rounds, the backends in turn (reversed every other round), each
    # backend's best kept: a burst of load on a shared machine that slows one backend's
    # turn does not decide a choice that is then cached.
    names = list(backends)
    for round_ in range(MEASURE_ROUNDS):
        for name in names if round_ % 2 == 0 else names[::-1]:
            calls = _rotation_calls(backends[name], order, weights)
            decode = _rotation_times(calls, decode_x)
            first: dict[str, object] = {}  # each shape's first call: the weight itself
            for key, fn in calls:
                first.setdefault(key, fn)
            for shape in shapes:
                x = prefill_x.get(shape.key)
                prefill = decode[shape.key] if x is None else choice_cache.best_of(
                    lambda fn=first[shape.key], x=x: fn(x))
                old = out[shape.key].get(name, (float("inf"), float("inf")))
                out[shape.key][name] = (min(old[0], decode[shape.key]), min(old[1], prefill))
            del calls, first  # (this backend's packed copies, before the next one packs)
    return out


def fastest(times: dict[str, tuple[float, float]]) -> str:
    """The backend whose (decode, prefill) times lose least against the best of each,
    decode and prefill counted alike as ratios: summed as seconds, a prefill call (many
    times a decode call's time) would decide alone."""
    best_decode = min(t[0] for t in times.values())
    best_prefill = min(t[1] for t in times.values())

    def loss(name: str) -> float:
        decode, prefill = times[name]
        return decode / max(best_decode, 1e-12) + prefill / max(best_prefill, 1e-12)

    return min(times, key=loss)


def _rotation_calls(backend, order: list[LinearShape], weights: dict[str, torch.Tensor]
                    ) -> list[tuple[str, object]]:
    """(shape key, forward) of every call in ``order``, each on a weight of its own packed
    by ``backend``: a shape's first call on the weight itself, the later ones on copies."""
    calls, seen = [], set()
    for s in order:
        w = weights[s.key] if s.key not in seen else weights[s.key].clone()
        seen.add(s.key)
        calls.append((s.key, _forward(backend.make_linear(w, None, gate_up=s.gate_up), s)))
    return calls


def _rotation_times(calls: list[tuple[str, object]], xs: dict[str, torch.Tensor]
                    ) -> dict[str, float]:
    """Seconds per call of each shape at decode rows: the fastest of ``ROTATION_PASSES``
    passes over ``calls`` after an untimed one, averaged over the shape's calls in a
    pass."""
    per_pass = Counter(key for key, _ in calls)
    best = dict.fromkeys(per_pass, float("inf"))
    clock = time.perf_counter
    for timed in range(ROTATION_PASSES + 1):
        spent = dict.fromkeys(per_pass, 0.0)
        for key, fn in calls:
            x = xs[key]
            t = clock()
            fn(x)
            spent[key] += clock() - t
        if timed:
            for key, s in spent.items():
                best[key] = min(best[key], s / per_pass[key])
    return best


def choose(shapes: list[LinearShape], backends: dict[str, object], device: torch.device,
           dtype: torch.dtype, decode_rows: int, prefill_rows: int,
           counts: dict[str, int] | None = None) -> dict[str, str]:
    """Shape key -> the fastest backend's name, from the cache or measured now
    (``counts``: how many weights of each shape key the model has, for ``measure``)."""
    prefill_rows = max(1, min(prefill_rows, PREFILL_ROWS_CAP))
    decode_rows = max(1, min(decode_rows, prefill_rows))
    names = list(backends)
    key = _cache_key(shapes, dtype, (decode_rows, prefill_rows), names, counts)
    entry = choice_cache.read("linear").get(key)
    if entry is not None and set(entry["choice"]) == {s.key for s in shapes} \
            and set(entry["choice"].values()) <= set(names):
        logger.info("linear backends (cached for this CPU): %s", entry["choice"])
        return dict(entry["choice"])
    t0 = time.perf_counter()
    timings = measure(shapes, backends, device, dtype, decode_rows, prefill_rows, counts)
    choice = {k: fastest(times) for k, times in timings.items()}
    logger.info("linear backends measured in %.1f s on %s (%d decode, %d prefill rows): "
                "%s; (decode, prefill) ms per shape: %s", time.perf_counter() - t0,
                cpu_model_name(), decode_rows, prefill_rows, choice,
                {k: {n: tuple(round(1e3 * x, 3) for x in t) for n, t in v.items()}
                 for k, v in timings.items()})
    choice_cache.store("linear", key, {"choice": choice, "cpu": cpu_model_name(),
                                       "timings_s": timings})
    return choice
