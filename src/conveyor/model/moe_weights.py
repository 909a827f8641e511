"""Experts' weights from a checkpoint into ``layers/moe.SparseMoE``'s stacked ``w13`` and
``w2``, in place (each tensor, or each rank's part of it, is copied straight into its
rows of the stacked parameter: no second copy of the experts is ever held).

Both layouts transformers writes or reads: one tensor per expert (Mixtral's
``block_sparse_moe.experts.E.w1/w3/w2``, Qwen3-MoE's ``mlp.experts.E.gate_proj/up_proj/
down_proj``) and stacked (``mlp.experts.gate_up_proj`` [E, 2 I, H], ``down_proj``
[E, H, I]). Under tensor parallelism a rank reads its slice of the intermediate dimension
only (``safe_open(...).get_slice``).
"""

from __future__ import annotations

import re

import torch

from conveyor.distributed.parallel import TPShard

_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                         r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\."
                      r"(gate_up_proj|down_proj)$")
_MIXTRAL_ROUTER = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight$")
# Gate rows first, then up rows, in w13 (transformers' gate_up_proj order).
_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}


def router_name(name: str) -> str | None:
    """Mixtral's router under our name (Qwen3-MoE's ``mlp.gate`` is ours already)."""
    m = _MIXTRAL_ROUTER.match(name)
    return f"layers.{m.group(1)}.mlp.gate.weight" if m else None


def expected_keys(name: str, param: torch.Tensor) -> set[str] | None:
    """The pieces a stacked expert parameter is filled from (None: not one)."""
    if name.endswith(".mlp.w13"):
        return {f"{name}#{e}.{p}" for e in range(param.shape[0]) for p in (0, 1)}
    if name.endswith(".mlp.w2"):
        return {f"{name}#{e}" for e in range(param.shape[0])}
    return None


def load_expert_tensor(name: str, src, params: dict[str, torch.nn.Parameter],
                       tp: TPShard) -> list[str] | None:
    """Copy checkpoint tensor ``name`` (``src``: its safetensors slice) into its stacked
    parameter; the pieces filled, or None if it is no expert weight."""
    m = _PER_EXPERT.match(name)
    if m:
        layer, expert, proj = int(m.group(1)), int(m.group(2)), m.group(3)
        if proj in ("w2", "down_proj"):
            dst = params[f"layers.{layer}.mlp.w2"]
            inter = dst.shape[2]
            _copy(dst.data[expert], src[:, tp.rank * inter:(tp.rank + 1) * inter], name)
            return [f"layers.{layer}.mlp.w2#{expert}"]
        dst = params[f"layers.{layer}.mlp.w13"]
        inter, part = dst.shape[1] // 2, _PART[proj]
        _copy(dst.data[expert, part * inter:(part + 1) * inter],
              src[tp.rank * inter:(tp.rank + 1) * inter], name)
        return [f"layers.{layer}.mlp.w13#{expert}.{part}"]
    m = _STACKED.match(name)
    if not m:
        return None
    layer, proj = int(m.group(1)), m.group(2)
    if proj == "down_proj":
        dst = params[f"layers.{layer}.mlp.w2"]
        inter = dst.shape[2]
        _copy(dst.data, src[:, :, tp.rank * inter:(tp.rank + 1) * inter], name)
        return [f"layers.{layer}.mlp.w2#{e}" for e in range(dst.shape[0])]
    dst = params[f"layers.{layer}.mlp.w13"]
    inter, full = dst.shape[1] // 2, src.get_shape()[1] // 2
    filled = []
    for part in (0, 1):
        lo = part * full + tp.rank * inter
        _copy(dst.data[:, part * inter:(part + 1) * inter], src[:, lo:lo + inter], name)
        filled += [f"layers.{layer}.mlp.w13#{e}.{part}" for e in range(dst.shape[0])]
    return filled


def _copy(dst: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if dst.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != this rank's "
                         f"{tuple(dst.shape)}")
    dst.copy_(tensor)


def full_shape(name: str, param: torch.Tensor, tp: TPShard) -> tuple[int, ...] | None:
    """The unsharded shape of a stacked expert parameter (None: not one)."""
    if name.endswith(".mlp.w13"):
        e, two_inter, hidden = param.shape
        return (e, two_inter * tp.world_size, hidden)
    if name.endswith(".mlp.w2"):
        e, hidden, inter = param.shape
        return (e, hidden, inter * tp.world_size)
    return None


def keep_rank_part(name: str, param: torch.Tensor, full: torch.Tensor, tp: TPShard) -> None:
    """This rank's slice of an unsharded stacked expert parameter into ``param``."""
    if name.endswith(".mlp.w13"):
        inter = param.shape[1] // 2
        halves = full.view(full.shape[0], 2, -1, full.shape[2])
        param.data.copy_(halves[:, :, tp.rank * inter:(tp.rank + 1) * inter].reshape(
            param.shape))
    else:
        inter = param.shape[2]
        param.data.copy_(full[:, :, tp.rank * inter:(tp.rank + 1) * inter])
