"""Where a checkpoint's expert weights go in ``layers/moe.SparseMoE`` (each expert's
``experts.E.gate_up_proj`` and ``experts.E.down_proj``), for the loader.

Both layouts transformers writes or reads: one tensor per expert (Mixtral's
``block_sparse_moe.experts.E.w1/w3/w2``, Qwen3-MoE's ``mlp.experts.E.gate_proj/up_proj/
down_proj``), which map onto our names as the dense MLP's do (the loader then slices and
copies them as any projection), and stacked (``mlp.experts.gate_up_proj`` [E, 2 I, H],
``mlp.experts.down_proj`` [E, H, I]), read one expert at a time into its own weights: no
second copy of the experts is held.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from conveyor.distributed.parallel import TPShard

_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                         r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\."
                      r"(gate_up_proj|down_proj)$")
_MIXTRAL_ROUTER = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight$")
# (our projection, shard): gate rows first, then up rows, as transformers' gate_up_proj.
_PROJ = {"w1": ("gate_up_proj", 0), "gate_proj": ("gate_up_proj", 0),
         "w3": ("gate_up_proj", 1), "up_proj": ("gate_up_proj", 1),
         "w2": ("down_proj", None), "down_proj": ("down_proj", None)}


def expert_target(name: str) -> tuple[str, int | None] | None:
    """Our parameter and shard of a per-expert tensor or of Mixtral's router (Qwen3-MoE's
    ``mlp.gate`` is ours already); None for anything else."""
    m = _PER_EXPERT.match(name)
    if m:
        proj, shard = _PROJ[m.group(3)]
        return f"layers.{m.group(1)}.mlp.experts.{m.group(2)}.{proj}.weight", shard
    m = _MIXTRAL_ROUTER.match(name)
    return (f"layers.{m.group(1)}.mlp.gate.weight", None) if m else None


def stacked_pieces(name: str, src) -> Iterator[tuple[str, int | None, int, torch.Tensor]]:
    """A stacked tensor's pieces, one expert read at a time: (our parameter, shard, its
    first row within the expert's tensor, the expert's whole tensor); nothing if ``name``
    is not a stacked expert tensor."""
    m = _STACKED.match(name)
    if not m:
        return
    layer, proj = m.group(1), m.group(2)
    for e in range(src.get_shape()[0]):
        whole = src[e:e + 1][0]
        our = f"layers.{layer}.mlp.experts.{e}.{proj}.weight"
        if proj == "down_proj":
            yield our, None, 0, whole
        else:
            half = whole.shape[0] // 2
            yield our, 0, 0, whole
            yield our, 1, half, whole


def expert_full_shape(name: str, param: torch.Tensor, tp: TPShard) -> tuple[int, ...] | None:
    """The unsharded shape of an expert's projection (None: not one): its rank holds a
    slice of the expert's intermediate dimension."""
    if ".mlp.experts." not in name:
        return None
    rows, cols = param.shape
    return (rows * tp.world_size, cols) if ".gate_up_proj." in name else (
        rows, cols * tp.world_size)
