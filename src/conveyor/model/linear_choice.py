"""Linear backends chosen by measurement, per weight shape, on the machine at hand.

Kernels tuned to one CPU lose on the next: on a Zen 3 with AVX2 only, conveyor's own
GEMM beat oneDNN; on a Zen 5 with AVX-512, oneDNN's decode step is 1.4x faster than it
(``benchmarks/decode_step.py --linear-backend native|onednn``). So ``linear_backend
="auto"`` times every candidate that supports the model (registered linear backends:
native, onednn, torch) on each of the model's own weight shapes, at a decode row
count (``max_num_seqs``) and a prefill one (the token budget, capped), and packs each
projection with the fastest. The choice is cached per CPU model, flags, torch version,
thread count, dtype, shapes and row counts (``<cache>/linear_choice.json``), logged,
and ``--linear-backend NAME`` still forces one; ``CONVEYOR_MEASURE_LINEARS=0`` keeps the
static priority order.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.model import choice_cache
from conveyor.model.dtypes import cpu_model_name

logger = logging.getLogger(__name__)

PREFILL_ROWS_CAP = 512  # enough rows to be compute-bound; keeps the measurement short


@dataclass(frozen=True)
class LinearShape:
    out_features: int
    in_features: int
    gate_up: bool = False  # silu(gate) * up follows (fused by backends that can)
    lm_head: bool = False  # runs on the sampled rows only: decode rows in both cases

    @property
    def key(self) -> str:
        tag = "+silu" if self.gate_up else ("+head" if self.lm_head else "")
        return f"{self.out_features}x{self.in_features}{tag}"


def measuring_enabled() -> bool:
    return choice_cache.switched_on("CONVEYOR_MEASURE_LINEARS")


def model_shapes(model: nn.Module, lm_head: torch.Tensor) -> list[LinearShape]:
    """The distinct weight shapes of a model's ``nn.Linear``s and its LM head."""
    shapes = {LinearShape(*child.weight.shape, gate_up=name == "gate_up_proj")
              for parent in model.modules() for name, child in parent.named_children()
              if isinstance(child, nn.Linear)}
    shapes.add(LinearShape(*lm_head.shape, lm_head=True))
    return sorted(shapes, key=lambda s: s.key)


def _cache_key(shapes: list[LinearShape], dtype: torch.dtype, rows: tuple[int, int],
               candidates: list[str]) -> str:
    return choice_cache.key(str(dtype), repr(rows), ",".join(candidates),
                            ",".join(s.key for s in shapes))


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
            dtype: torch.dtype, decode_rows: int, prefill_rows: int
            ) -> dict[str, dict[str, float]]:
    """Seconds per (shape key, backend name): one decode-sized plus one prefill-sized call
    (the LM head: two decode-sized ones)."""
    gen = torch.Generator().manual_seed(0)
    out: dict[str, dict[str, float]] = {}
    for shape in shapes:
        w = (torch.randn(shape.out_features, shape.in_features, generator=gen) * 0.02).to(
            device=device, dtype=dtype)
        rows = (decode_rows, decode_rows if shape.lm_head else prefill_rows)
        xs = [torch.randn(r, shape.in_features, generator=gen).to(device=device, dtype=dtype)
              for r in rows]
        out[shape.key] = {}
        for name, backend in backends.items():
            fn = _forward(backend.make_linear(w, None, gate_up=shape.gate_up), shape)
            out[shape.key][name] = sum(choice_cache.best_of(lambda fn=fn, x=x: fn(x))
                                       for x in xs)
    return out


def choose(shapes: list[LinearShape], backends: dict[str, object], device: torch.device,
           dtype: torch.dtype, decode_rows: int, prefill_rows: int) -> dict[str, str]:
    """Shape key -> the fastest backend's name, from the cache or measured now."""
    prefill_rows = max(1, min(prefill_rows, PREFILL_ROWS_CAP))
    decode_rows = max(1, min(decode_rows, prefill_rows))
    names = list(backends)
    key = _cache_key(shapes, dtype, (decode_rows, prefill_rows), names)
    entry = choice_cache.read("linear").get(key)
    if entry is not None and set(entry["choice"]) == {s.key for s in shapes} \
            and set(entry["choice"].values()) <= set(names):
        logger.info("linear backends (cached for this CPU): %s", entry["choice"])
        return dict(entry["choice"])
    t0 = time.perf_counter()
    timings = measure(shapes, backends, device, dtype, decode_rows, prefill_rows)
    choice = {k: min(times, key=times.get) for k, times in timings.items()}
    logger.info("linear backends measured in %.1f s on %s (%d decode, %d prefill rows): "
                "%s; ms per shape: %s", time.perf_counter() - t0, cpu_model_name(), decode_rows,
                prefill_rows, choice,
                {k: {n: round(1e3 * t, 3) for n, t in v.items()} for k, v in timings.items()})
    choice_cache.store("linear", key, {"choice": choice, "cpu": cpu_model_name(),
                                       "timings_s": timings})
    return choice
