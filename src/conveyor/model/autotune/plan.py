"""The one plan of backends a model runs with: which attention backend (and whether its
own prefill kernel beats SDPA), which linear backend for each weight shape, and how many
rows of a call go to conveyor's GEMM on a second copy of the weights.

A backend named by the user (``--attention-backend``, ``--linear-backend``) is taken as
it is; ``auto`` takes the registered backend of highest priority that applies, or,
where more than one applies and measuring is on (``CONVEYOR_MEASURE_ATTENTION``,
``CONVEYOR_MEASURE_LINEARS``), the fastest measured on this machine (cached).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from conveyor.model.attention.registry import (
    attention_backend_names_for,
    attention_backends,
    select_attention_backend,
)
from conveyor.model.autotune import attention as attention_choice
from conveyor.model.autotune import few_rows
from conveyor.model.autotune import linears as linear_choice
from conveyor.model.layers.moe import expert_linears
from conveyor.model.linear.native import native_gemm_lib
from conveyor.model.linear.registry import (
    linear_backend_names_for,
    pick_linear_backend,
    select_linear_backend,
)
from conveyor.model.linear.shape import LinearShape, model_shape_counts


@dataclass
class BackendPlan:
    # The attention backend's name, or ``auto`` where nothing was measured (then the
    # registry's first that applies).
    attention: str
    own_prefill: bool  # its own prefill kernel for fresh prompts (False: SDPA)
    linear: str  # the linear backend everywhere, or the one most shapes use
    # Shape key (``LinearShape.key``) -> linear backend, where chosen per shape; empty:
    # ``linear`` for every projection.
    linear_by_shape: dict[str, str] = field(default_factory=dict)
    few_rows: int = 0  # calls of up to this many rows to conveyor's GEMM (0: none)
    # The linear backend of the mixture-of-experts blocks' experts, packed before the rest
    # ('': as the rest).
    experts: str = ""
    gemm_lib: object | None = field(default=None, repr=False)  # the GEMM's kernels


@dataclass(frozen=True)
class ModelShape:
    """What the backends are chosen for: this rank's heads and the model's dtypes."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the arithmetic's
    weight_dtype: torch.dtype | None = None  # the checkpoint's, where it differs


def plan_backends(model: nn.Module, shape: ModelShape, device: torch.device,
                  attention_backend: str = "auto", linear_backend: str = "auto",
                  linear_rows: tuple[int, int] = (32, 512)) -> BackendPlan:
    """The backends for ``model`` (a decoder with ``layers`` and ``lm_head_weight``);
    ``linear_rows``: the decode and prefill row counts ``auto`` times at
    (``max_num_seqs``, the token budget)."""
    attention, own_prefill = _plan_attention(shape, device, attention_backend,
                                             linear_rows[0])
    plan = BackendPlan(attention, own_prefill,
                       pick_linear_backend(linear_backend, device, shape.dtype,
                                           shape.weight_dtype))
    candidates = linear_backend_names_for(device, shape.dtype, shape.weight_dtype)
    experts = expert_linears(model.layers)
    if linear_backend == "auto" and experts:
        plan.experts = _experts_backend(candidates)
    if linear_backend == "auto" and len(candidates) > 1 and linear_choice.measuring_enabled():
        skip = frozenset(map(id, experts)) if plan.experts else frozenset()
        counts = model_shape_counts(model.layers, model.lm_head_weight, skip)
        plan.linear_by_shape = linear_choice.choose(
            sorted(counts, key=lambda s: s.key),
            {n: select_linear_backend(n, device, shape.dtype, shape.weight_dtype)
             for n in candidates},
            device, shape.dtype, *linear_rows, {s.key: n for s, n in counts.items()})
        used = list(plan.linear_by_shape.values())
        plan.linear = max(set(used), key=used.count)  # the most used, for logs
        plan.few_rows, plan.gemm_lib = _plan_few_rows(counts, plan.linear, shape, device,
                                                      linear_rows[0])
    return plan


def _experts_backend(candidates: list[str]) -> str:
    """The experts' backend under ``auto``: conveyor's GEMM wherever it applies, since
    there a block's experts run as two grouped native calls (``SparseMoE.grouped_gemms``)
    and the per-shape measurement times one projection's GEMM, not that call; bf16
    weights kept as they are where the checkpoint has them (half the bytes, the same
    values). '' where no native backend applies: the experts are measured as the rest."""
    for name in ("native-bf16", "native"):
        if name in candidates:
            return name
    return ""


def _plan_attention(shape: ModelShape, device: torch.device, name: str,
                    decode_rows: int) -> tuple[str, bool]:
    """(attention backend, whether its own prefill kernel is used): measured where
    ``auto`` has more than one to choose from, else ``name`` as asked (checked here;
    ``auto`` resolved by the registry when applied)."""
    heads = (shape.num_heads, shape.num_kv_heads, shape.head_dim)
    if name == "auto" and attention_choice.measuring_enabled():
        names = attention_backend_names_for(device, shape.dtype, *heads)
        if len(names) > 1:
            return attention_choice.choose(
                {n: select_attention_backend(n, device, shape.dtype, *heads) for n in names},
                device, shape.dtype, *heads, decode_rows=decode_rows)
    attention_backends.select(name, device, shape.dtype, *heads)  # (raises if it cannot run)
    return name, True


def _plan_few_rows(counts: dict[LinearShape, int], linear: str, shape: ModelShape,
                   device: torch.device, decode_rows: int) -> tuple[int, object | None]:
    """(rows, the GEMM's kernels): how many rows of a call go to conveyor's GEMM on a
    second copy of each projection (a float32 or bf16 model on a CPU with the GEMM,
    measured), 0 where none do."""
    dtype = shape.dtype
    lib = native_gemm_lib() if device.type == "cpu" else None
    # (a bf16 checkpoint computed in float32 reads bf16 weights already: native-bf16)
    if dtype not in (torch.float32, torch.bfloat16) or shape.weight_dtype is not None \
            or lib is None or linear.startswith("native") \
            or all(s.lm_head for s in counts):  # (projections quantized: no float ones)
        return 0, None
    many = select_linear_backend(linear, device, dtype, shape.weight_dtype)
    return few_rows.choose(counts, linear, many, lib, dtype, decode_rows), lib
