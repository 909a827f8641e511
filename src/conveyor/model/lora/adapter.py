"""A PEFT LoRA checkpoint read into the decoder's terms: per (layer, target) the A [r, in]
and B [out, r] matrices and the scaling (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA;
``rank_pattern`` and ``alpha_pattern`` per module as PEFT matches them). Under tensor
parallelism each rank keeps its part, as the layer it adapts: B's rows of its heads (q, k,
v) or intermediate (gate, up), A's columns of its heads (o) or intermediate (down)."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

import torch

from conveyor.config.lora import LORA_TARGETS, LoRARequest, check_adapter
from conveyor.distributed.parallel import SINGLE, TPShard

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRAModule:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float


@dataclass
class FusedLoRA:
    """An adapter's targets within one (packed) projection: ``a`` [n * rank, in], the
    targets' A stacked, each in its own ``rank`` rows (``--max-lora-rank``; zero rows pad
    a lower rank or an absent target), so every adapter's has the same shape and a step
    can stack them; per target, ``b_t[i]`` [rank, width] its B transposed (zeros where
    absent) and ``scaling[i]`` (0.0 where absent)."""

    a: torch.Tensor
    b_t: list[torch.Tensor]
    scaling: list[float]
    present: list[int]  # the targets adapted (indices into the projection's slices)


@dataclass
class LoRAAdapter:
    request: LoRARequest
    rank: int
    # (layer index, target name such as "q_proj") -> its matrices
    modules: dict[tuple[int, str], LoRAModule] = field(default_factory=dict)
    # (layer index, first target of the projection) -> its fused form (``fuse``)
    fused: dict[tuple[int, str], FusedLoRA] = field(default_factory=dict)

    @property
    def id(self) -> int:
        return self.request.lora_int_id

    def fuse(self, layer: int, slices: list[tuple[str, int, int]], max_rank: int) -> None:
        """Build the fused form for a projection whose targets sit at ``slices`` (target,
        first column, width); nothing if no target is adapted."""
        present = [i for i, (t, _, _) in enumerate(slices) if (layer, t) in self.modules]
        if not present:
            return
        ref = self.modules[(layer, slices[present[0]][0])].a
        a = ref.new_zeros(len(slices) * max_rank, ref.shape[1])
        b_t, scaling = [], []
        for i, (target, _, width) in enumerate(slices):
            b = ref.new_zeros(max_rank, width)
            m = self.modules.get((layer, target))
            if m is not None:
                r = m.a.shape[0]
                a[i * max_rank:i * max_rank + r] = m.a
                b[:r] = m.b.t()
            b_t.append(b)
            scaling.append(m.scaling if m is not None else 0.0)
        self.fused[(layer, slices[0][0])] = FusedLoRA(a, b_t, scaling, present)


def _pattern_value(patterns: dict, module_name: str, default: float) -> float:
    """PEFT's rule: a pattern key matches a module name that ends with it (after a dot)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module_name):
            return value
    return default


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        return load_file(st)
    return torch.load(os.path.join(path, "adapter_model.bin"), map_location="cpu",
                      weights_only=True)


def load_adapter(request: LoRARequest, model, max_rank: int, dtype: torch.dtype,
                 tp: TPShard = SINGLE) -> LoRAAdapter:
    """Read ``request``'s PEFT checkpoint for ``model`` (a ``DecoderForCausalLM``): every
    tensor must be a LoRA A or B of a target in ``LORA_TARGETS`` within the model's layers
    (ValueError naming the first that is not)."""
    cfg = check_adapter(request.lora_path, max_rank)
    tensors = _read_tensors(request.lora_path)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    num_layers = len(model.layers)
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in LORA_TARGETS or int(m.group(1)) >= num_layers:
            raise ValueError(f"adapter {request.lora_name!r}: tensor {key!r} is not a LoRA "
                             f"of {', '.join(LORA_TARGETS)} in the model's layers")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
    adapter = LoRAAdapter(request, 0)
    for (layer, target), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter {request.lora_name!r}: layer {layer} {target} lacks "
                             f"lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        r = a.shape[0]
        if r > max_rank:
            raise ValueError(f"adapter {request.lora_name!r} has rank {r}, above "
                             f"--max-lora-rank {max_rank}")
        part = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        name = f"model.layers.{layer}.{part}.{target}"
        rank = _pattern_value(cfg.get("rank_pattern"), name, cfg.get("r", r))
        alpha = _pattern_value(cfg.get("alpha_pattern"), name, cfg.get("lora_alpha", rank))
        scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
        a, b = _shard(model, target, a, b, tp)
        adapter.modules[(layer, target)] = LoRAModule(
            a.to(dtype).contiguous(), b.to(dtype).contiguous(), float(scaling))
        adapter.rank = max(adapter.rank, r)
    return adapter


def _shard(model, target: str, a: torch.Tensor, b: torch.Tensor, tp: TPShard
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part: the rows (B) or columns (A) its copy of the layer holds."""
    if not tp.enabled:
        return a, b
    cfg = model.cfg
    hd = cfg.head_dim
    split = tp.heads(cfg.num_heads, cfg.num_kv_heads)
    attn = model.layers[0].self_attn
    inter = model.layers[0].mlp.intermediate
    if target == "q_proj":
        return a, b[split.q_start * hd:split.q_start * hd + attn.q_size]
    if target in ("k_proj", "v_proj"):
        return a, b[split.kv_start * hd:split.kv_start * hd + attn.kv_size]
    if target in ("gate_proj", "up_proj"):
        return a, b[tp.rank * inter:(tp.rank + 1) * inter]
    if target == "o_proj":
        return a[:, split.q_start * hd:split.q_start * hd + attn.q_size], b
    return a[:, tp.rank * inter:(tp.rank + 1) * inter], b  # down_proj
