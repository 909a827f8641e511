"""Build a model and fill its weights from safetensors files, or randomly (dummy).

Under tensor parallelism (``TPShard``) each rank reads only its slices of the checkpoint
(``safe_open(...).get_slice``): its heads' rows of Q, K and V, its rows of gate and up,
its input columns of o_proj and down_proj, its vocabulary rows; norms are replicated.
"""

from __future__ import annotations

import glob
import json
import os
import re

import torch

from conveyor.config import ModelConfig
from conveyor.distributed.parallel import SINGLE, TPShard
from conveyor.model import moe_weights
from conveyor.model.layers.rotary import RotaryEmbedding
from conveyor.model.models.decoder import DecoderForCausalLM
from conveyor.model.models.registry import model_class
from conveyor.model.quant.load import keep_quantized, open_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Checkpoint tensors that are packed into one of ours: (our name, index within the pack).
_PACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")


def load_model(cfg: ModelConfig, device: torch.device, tp: TPShard = SINGLE
               ) -> DecoderForCausalLM:
    dtype = DTYPES[cfg.math_dtype]
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, tp)
    model = model.to(dtype=dtype).to_empty(device=device)
    # The rope tables are buffers, not weights: rebuild them in float32 on the device
    # (they are cast per use, as transformers does).
    model.rope = RotaryEmbedding(cfg.hf_config, cfg.head_dim,
                                 cfg.max_position_embeddings).to(device)
    if cfg.load_format == "dummy":
        _init_dummy(model, cfg.seed, tp)
    else:
        _load_safetensors(model, cfg.path, tp)
    if cfg.math_dtype != cfg.dtype:
        # Computing in another dtype than the weights': keep the weights' values.
        storage = DTYPES[cfg.dtype]
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.to(storage))
    model.after_load(device)
    return model.eval().requires_grad_(False)


def _init_dummy(model: DecoderForCausalLM, seed: int, tp: TPShard = SINGLE) -> None:
    """Random weights of the right shape; norms at 1 so activations stay well scaled.
    Under tensor parallelism a rank draws the whole tensor and keeps its part, so that
    every tensor-parallel size runs the same model (the same tokens)."""
    gen = torch.Generator(device=model.embed_tokens.weight.device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith("bias"):
            param.data.zero_()
        elif not tp.enabled:
            param.data.normal_(0.0, 0.02, generator=gen)
        else:
            full = torch.empty(_full_shape(model, name, param), dtype=param.dtype,
                               device=param.device).normal_(0.0, 0.02, generator=gen)
            _keep_rank_part(model, name, param, full, tp)


def _full_shape(model: DecoderForCausalLM, name: str, param: torch.Tensor) -> tuple[int, ...]:
    cfg = model.cfg
    hd, hidden = cfg.head_dim, cfg.hidden_size
    expert = moe_weights.expert_full_shape(name, param, model.tp)
    if expert is not None:
        return expert
    if ".qkv_proj." in name:
        return ((cfg.num_heads + 2 * cfg.num_kv_heads) * hd, hidden)
    if ".gate_up_proj." in name:
        return (2 * cfg.intermediate_size, hidden)
    if name.endswith("o_proj.weight"):
        return (hidden, cfg.num_heads * hd)
    if name.endswith("down_proj.weight"):
        return (hidden, cfg.intermediate_size)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return (cfg.vocab_size, hidden)
    return tuple(param.shape)


def _keep_rank_part(model: DecoderForCausalLM, name: str, param: torch.Tensor,
                    full: torch.Tensor, tp: TPShard) -> None:
    """Copy this rank's part of an unsharded (packed, as ours) tensor into ``param``."""
    cfg = model.cfg
    packed = None
    if ".qkv_proj." in name:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        packed = full.split([q, kv, kv])
    elif ".gate_up_proj." in name:
        packed = full.split(full.shape[0] // 2)  # an expert's intermediate, or the MLP's
    if packed is None:
        part = _rank_slice(model, name, None, full, tp)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            param.data.zero_()
        param.data.narrow(0, 0, part.shape[0]).copy_(part)
        return
    start = 0
    for shard, piece in enumerate(packed):
        part = _rank_slice(model, name, shard, piece, tp)
        param.data.narrow(0, start, part.shape[0]).copy_(part)
        start += part.shape[0]


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path!r} (use load_format='dummy' "
                         "for random weights)")
    return files


def _load_safetensors(model: DecoderForCausalLM, path: str, tp: TPShard = SINGLE) -> None:
    params = dict(model.named_parameters())
    filled: set[str] = set()
    files = _weight_files(path)
    for file in files:
        with open_weights(file, files, model.cfg) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                stacked = False  # experts stacked in one tensor: into each expert's own
                for our, shard, start, whole in moe_weights.stacked_pieces(
                        name, f.get_slice(name)):
                    _fill_shard(model, params[our], our, shard, whole, tp, start,
                                whole.shape[0] // (1 if shard is None else 2))
                    filled.add(f"{our}#{shard}")
                    stacked = True
                if stacked:
                    continue
                target = _target(model, name)
                if target is None:
                    continue
                our_name, shard = target
                if shard == FUSED:  # Phi-3's own qkv_proj / gate_up_proj: every shard
                    for i, (start, size) in enumerate(_fused_pieces(model, our_name)):
                        _fill_shard(model, params[our_name], our_name, i,
                                    f.get_slice(name), tp, start, size)
                        filled.add(f"{our_name}#{i}")
                    continue
                param = params[our_name]
                if tp.enabled:
                    tensor = _rank_slice(model, our_name, shard, f.get_slice(name), tp)
                    if our_name.endswith(("embed_tokens.weight", "lm_head.weight")):
                        param.data.zero_()  # the last shard's rows past the vocabulary
                        param = param.data.narrow(0, 0, tensor.shape[0])
                else:
                    tensor = f.get_tensor(name)
                tensor = keep_quantized(model, our_name, shard, tensor, param.dtype)
                _copy_shard(model, our_name, shard, param, tensor)
                filled.add(f"{our_name}#{shard}")
    expected = set()
    for name in params:
        parts = _num_shards(name)
        expected.update(f"{name}#{i}" for i in range(parts)) if parts else expected.add(
            f"{name}#None")
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights: {missing[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")


# A checkpoint tensor already packed as ours (Phi-3's qkv_proj and gate_up_proj).
FUSED = -1


def _fused_pieces(model: DecoderForCausalLM, our_name: str) -> list[tuple[int, int]]:
    """(first row, rows) of each shard within a whole (unsharded) packed tensor."""
    cfg = model.cfg
    if ".qkv_proj." in our_name:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [(0, q), (q, kv), (q + kv, kv)]
    inter = cfg.intermediate_size
    return [(0, inter), (inter, inter)]


class _Rows:
    """Rows ``[start, start + size)`` of a safetensors slice, indexed as its own tensor
    (``_rank_slice`` then reads a rank's rows of one shard of a packed tensor)."""

    def __init__(self, src, start: int, size: int) -> None:
        self.src, self.start, self.size = src, start, size

    def __getitem__(self, rows: slice) -> torch.Tensor:
        lo, hi, _ = rows.indices(self.size)
        return self.src[self.start + lo:self.start + hi]


def _fill_shard(model: DecoderForCausalLM, param: torch.nn.Parameter, our_name: str,
                shard: int, src, tp: TPShard, start: int, size: int) -> None:
    """One shard of a checkpoint tensor that is packed already, read without the rest."""
    rows = _Rows(src, start, size)
    if shard is None:  # a whole (unpacked) projection: _rank_slice reads its columns
        tensor = _rank_slice(model, our_name, None, src, tp) if tp.enabled else src[:]
    else:
        tensor = _rank_slice(model, our_name, shard, rows, tp) if tp.enabled else rows[:]
    _copy_shard(model, our_name, shard, param, tensor)


def _num_shards(name: str) -> int:
    if ".qkv_proj." in name:
        return 3
    if ".gate_up_proj." in name:
        return 2
    return 0


def _target(model: DecoderForCausalLM, name: str) -> tuple[str, int | None] | None:
    if name.startswith("model.layers."):
        expert = moe_weights.expert_target(name)
        if expert is not None:
            return expert
        m = _LAYER.match(name)
        if m and m.group(3) in _PACKED:
            layer, block, proj, kind = m.groups()
            packed, idx = _PACKED[proj]
            return f"layers.{layer}.{block}.{packed}.{kind}", idx
        if m and m.group(3) in ("qkv_proj", "gate_up_proj"):
            return name.removeprefix("model."), FUSED
        return name.removeprefix("model."), None
    if name in ("model.embed_tokens.weight", "model.norm.weight"):
        return name.removeprefix("model."), None
    if name == "lm_head.weight":
        return (None if model.tie_word_embeddings else ("lm_head.weight", None))
    return None  # rotary inv_freq buffers and other non-weights


def _rank_slice(model: DecoderForCausalLM, our_name: str, shard: int | None, src,
                tp: TPShard) -> torch.Tensor:
    """This rank's part of one checkpoint tensor (``src``: a safetensors slice), read
    without the rest."""
    cfg = model.cfg
    attn = model.layers[0].self_attn
    hd = cfg.head_dim
    if ".qkv_proj." in our_name:
        split = tp.heads(cfg.num_heads, cfg.num_kv_heads)
        start = split.q_start * hd if shard == 0 else split.kv_start * hd
        size = attn.q_size if shard == 0 else attn.kv_size
        return src[start:start + size]
    if ".gate_up_proj." in our_name:
        inter = model.layers[0].mlp.intermediate
        return src[tp.rank * inter:(tp.rank + 1) * inter]
    if our_name.endswith("o_proj.weight"):
        start = tp.heads(cfg.num_heads, cfg.num_kv_heads).q_start * hd
        return src[:, start:start + attn.q_size]
    if our_name.endswith("down_proj.weight"):
        inter = model.layers[0].mlp.intermediate
        return src[:, tp.rank * inter:(tp.rank + 1) * inter]
    if our_name.endswith(("embed_tokens.weight", "lm_head.weight")):
        rows = tp.vocab_shard(cfg.vocab_size)
        return src[tp.rank * rows:min(cfg.vocab_size, (tp.rank + 1) * rows)]
    if our_name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")) \
            and attn.qk_norm_full and tp.enabled:  # OLMo 2: its heads' part of the norm
        split = tp.heads(cfg.num_heads, cfg.num_kv_heads)
        if our_name.endswith("q_norm.weight"):
            return src[split.q_start * hd:split.q_start * hd + attn.q_size]
        return src[split.kv_start * hd:split.kv_start * hd + attn.kv_size]
    return src[:]  # norms: every rank holds them whole


def _copy_shard(model: DecoderForCausalLM, our_name: str, shard: int | None,
                param: torch.nn.Parameter, tensor: torch.Tensor) -> None:
    if shard is None:
        if param.shape != tensor.shape:
            raise ValueError(f"{our_name}: checkpoint shape {tuple(tensor.shape)} != "
                             f"model shape {tuple(param.shape)}")
        param.data.copy_(tensor)
        return
    if ".qkv_proj." in our_name:
        attn = model.layers[0].self_attn
        sizes = [attn.q_size, attn.kv_size, attn.kv_size]
    else:
        inter = model.layers[0].mlp.intermediate
        sizes = [inter, inter]
    start = sum(sizes[:shard])
    dst = param.data.narrow(0, start, sizes[shard])
    if dst.shape != tensor.shape:
        raise ValueError(f"{our_name}[{shard}]: checkpoint shape {tuple(tensor.shape)} != "
                         f"{tuple(dst.shape)}")
    dst.copy_(tensor)
