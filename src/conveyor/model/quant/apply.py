"""Putting quantized projections in a loaded model, before its float linears are planned.

Where the weights come from: a pre-quantized checkpoint's (the loader leaves them in
``model.quant_weights``: our parameter name -> shard -> ``QuantWeight``, the float
parameters holding their dequantised values), or ``--quantization int8`` / ``int4``,
which quantize every projection (int8 per output row; int4 in groups, ``int4_group``)
and the LM head in int8 per row (a small model's tied head is a quarter of its
weights). Each weight shape gets the quantized backends measured fastest on this machine
per row range (``autotune/row_ranges.py``: the one-row winner for calls up to a measured
row count, the larger calls' winner past it; one candidate: no measurement), unless
``CONVEYOR_QUANT_LINEAR`` names one.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from conveyor.config.quantization import ON_THE_FLY
from conveyor.distributed.parallel import TPShard
from conveyor.kernels.cpu import quant as qkernel
from conveyor.model.autotune import linears as linear_choice
from conveyor.model.autotune import row_ranges
from conveyor.model.autotune.row_ranges import RowRanges
from conveyor.model.linear.shape import LinearShape
from conveyor.model.quant.backends import Scheme, candidates, quant_linear_backends
from conveyor.model.quant.linear import RowRangeLinear
from conveyor.model.quant.weight import QuantWeight, cat_rows, quantize_int4, quantize_int8

logger = logging.getLogger(__name__)

QUANT_LINEAR = "CONVEYOR_QUANT_LINEAR"  # a quantized backend by name, for tests
_ROW_PARALLEL = ("o_proj", "down_proj")  # input columns split over ranks


def quantize_model(model: nn.Module, method: str | None, device: torch.device,
                   dtype: torch.dtype, rows: tuple[int, int], linear_backend: str,
                   tp: TPShard) -> str:
    """Replace the model's quantized projections (and head) by quantized modules; returns
    the linear backend for the float ones left (``torch`` where none is left)."""
    if method is None:
        return linear_backend
    sites: list[tuple[nn.Module, str, QuantWeight, torch.Tensor | None, LinearShape]] = []
    stored: dict[str, dict[int | None, QuantWeight]] = getattr(model, "quant_weights", {})
    for mod_name, parent in model.layers.named_modules():
        for name, child in parent.named_children():
            if not isinstance(child, nn.Linear):
                continue
            key = f"layers.{mod_name}.{name}.weight"
            if method == "int8":
                qw = _quantize_rows(child.weight, tp if name in _ROW_PARALLEL else None)
            elif method == "int4":
                qw = quantize_int4(child.weight, int4_group(child.weight.shape[1]))
            elif key in stored:
                parts = stored[key]
                qw = cat_rows([parts[i] for i in sorted(parts, key=lambda s: s or 0)])
            else:
                continue  # a projection the checkpoint left in float
            sites.append((parent, name, qw, child.bias,
                          LinearShape(*child.weight.shape, gate_up=name == "gate_up_proj")))
    head = None
    if method in ON_THE_FLY:
        head = quantize_int8(model.lm_head_weight)
        sites.append((model, "packed_lm_head", head, None,
                      LinearShape(*head.shape, lm_head=True)))
        if linear_backend not in ("auto", "torch"):
            raise ValueError(f"--linear-backend {linear_backend} chooses float kernels; "
                             f"with --quantization {method} every projection is quantized "
                             "(leave it at auto)")
    choice = _choose(sites, device, dtype, rows)
    for parent, name, qw, bias, shape in sites:
        ranges = choice[(Scheme.of(qw), shape.key)]
        # (a gate/up projection may apply silu(gate) * up itself: the MLP asks the module)
        gate_up = name == "gate_up_proj" and getattr(parent, "fuses_silu", False)

        def make(backend: str, qw=qw, bias=bias, gate_up=gate_up) -> nn.Module:
            return quant_linear_backends.get(backend)(device, dtype).make_linear(
                qw, bias, gate_up=gate_up)

        module = make(ranges.many)
        if ranges.few_rows:
            module = RowRangeLinear(make(ranges.few), module, ranges.few_rows)
        setattr(parent, name, module)
    if head is not None and not model.tie_word_embeddings:
        del model.lm_head
    if hasattr(model, "quant_weights"):
        del model.quant_weights
    logger.info("quantized (%s): %d projections%s, backends %s", method, len(sites),
                " and the LM head" if head is not None else "",
                sorted(set().union(*(r.names for r in choice.values()))))
    return "torch" if head is not None else linear_backend


def int4_group(in_features: int) -> int:
    """``--quantization int4``'s group size for a row of ``in_features``: 128 where it
    divides the row, else 64, else 32, else the whole row."""
    return next((g for g in (128, 64, 32) if in_features % g == 0), in_features)


def _quantize_rows(weight: torch.Tensor, tp: TPShard | None) -> QuantWeight:
    """Per-row int8; a row split over ranks takes the whole row's absmax, so that every
    tensor-parallel size quantizes alike."""
    absmax = weight.detach().abs().amax(dim=1).to(torch.float32)
    if tp is not None and tp.enabled:
        import torch.distributed as dist

        dist.all_reduce(absmax, op=dist.ReduceOp.MAX, group=tp.group)
    return quantize_int8(weight, absmax)


def _choose(sites, device: torch.device, dtype: torch.dtype, rows: tuple[int, int]
            ) -> dict[tuple[Scheme, str], RowRanges]:
    """(scheme, shape key) -> the quantized backends by row range: forced, the only
    candidate, or measured."""
    forced = os.environ.get(QUANT_LINEAR, "").strip()
    by_scheme: dict[Scheme, dict[LinearShape, int]] = {}
    for _, _, qw, _, shape in sites:
        counts = by_scheme.setdefault(Scheme.of(qw), {})
        counts[shape] = counts.get(shape, 0) + 1
    choice: dict[tuple[Scheme, str], RowRanges] = {}
    for scheme, counts in by_scheme.items():
        names = candidates(scheme, device, dtype)
        if forced:
            reason = quant_linear_backends.get(forced).supports(scheme, device, dtype)
            if reason is not None:
                raise ValueError(f"{QUANT_LINEAR}={forced}: {reason}")
            names = [forced]
        if not names:
            raise ValueError(f"no quantized linear backend runs {scheme.tag} weights on "
                             f"{device} in {dtype}")
        if len(names) == 1 or not linear_choice.measuring_enabled():
            choice.update({(scheme, s.key): RowRanges(names[0], 0, names[0]) for s in counts})
            continue
        # (keyed by scheme too: the measurement cache holds one choice per candidate set;
        # and by the quantized kernel's build, which the cache's kernel key leaves out)
        build = qkernel.build_id()
        backends = {f"{n}:{scheme.tag}:{build}": quant_linear_backends.get(n)(device, dtype,
                                                                              scheme)
                    for n in names}
        shapes = sorted(counts, key=lambda s: s.key)
        picked = row_ranges.choose(shapes, backends, device, dtype, *rows,
                                   {s.key: c for s, c in counts.items()})
        choice.update({(scheme, k): RowRanges(v.few.split(":")[0], v.few_rows,
                                              v.many.split(":")[0])
                       for k, v in picked.items()})
    return choice
