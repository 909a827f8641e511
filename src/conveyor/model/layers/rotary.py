"""Rotary position embedding: inverse frequencies with the checkpoint's rope scaling and
a precomputed cos/sin table (neox style)."""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_inv_freq(hf: dict, head_dim: int, layer_type: str | None = None) -> torch.Tensor:
    """Inverse frequencies with the checkpoint's rope scaling (default, linear, llama3;
    longrope's short factors, see ``longrope``).
    ``layer_type``: where ``rope_parameters`` is keyed by layer type (Gemma 3), that
    type's (``full_attention`` if None); Gemma 3's older configs name the local base
    ``rope_local_base_freq``."""
    params = _rope_params(hf, layer_type)
    base = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    # On the CPU always, even under ``torch.device("meta")`` (the model is built there):
    # arithmetic on meta tensors goes through torch._refs, which imports torch._dynamo and
    # with it triton, whose bindings print "leaked function" warnings at exit.
    arange = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu")
    inv = 1.0 / (base ** (arange.float() / head_dim))
    if rope_type == "default":
        return inv
    if rope_type == "longrope":
        return _longrope_inv(base, params["short_factor"], head_dim)
    if rope_type == "linear":
        return inv / params["factor"]
    if rope_type == "llama3":
        factor = params["factor"]
        low, high = params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope type {rope_type!r} (supported: default, linear, "
                     "llama3, longrope)")


def longrope(hf: dict, head_dim: int, layer_type: str | None = None
             ) -> tuple[torch.Tensor, int, float] | None:
    """Phi-3's ``longrope``: (the long factors' inverse frequencies, the original context
    length from which positions use them, the cos/sin scale), or None for another type.
    Positions below the original length use the short factors (``rope_inv_freq``), as
    transformers does for any sequence up to that length; beyond it transformers
    switches a whole sequence's frequencies at once, which a paged cache cannot (its
    K were rotated already), so positions there use the long factors (vLLM's choice)."""
    params = _rope_params(hf, layer_type)
    if (params.get("rope_type") or params.get("type")) != "longrope":
        return None
    base = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    orig = int(params.get("original_max_position_embeddings")
               or hf["original_max_position_embeddings"])
    factor = params.get("factor") or hf["max_position_embeddings"] / orig
    scale = params.get("attention_factor")
    if scale is None:
        scale = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1.0 else 1.0
    return _longrope_inv(base, params["long_factor"], head_dim), orig, float(scale)


def _rope_params(hf: dict, layer_type: str | None) -> dict:
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    if isinstance(params.get("full_attention"), dict):
        params, scaling = dict(params[layer_type or "full_attention"]), {}
    elif layer_type == "sliding_attention" and "rope_local_base_freq" in hf:
        params = {"rope_theta": hf["rope_local_base_freq"], "rope_type": "default"}
        scaling = {}
    params = {**scaling, **params}
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor "
                         f"{params['partial_rotary_factor']}) are not supported")
    return params


def _longrope_inv(base: float, factors: list[float], head_dim: int) -> torch.Tensor:
    """1 / (factor * base^(2i/d)), in transformers' order of operations."""
    # On the CPU, as ``rope_inv_freq``'s tables (meta arithmetic would import triton).
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32, device="cpu") * base ** exponent)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a precomputed cos/sin table."""

    def __init__(self, hf: dict, head_dim: int, max_positions: int,
                 layer_type: str | None = None) -> None:
        super().__init__()
        inv = rope_inv_freq(hf, head_dim, layer_type)
        freqs = (torch.arange(max_positions, dtype=torch.int64, device=inv.device).float()[:, None]
                 * inv[None, :])
        scale = 1.0
        long = longrope(hf, head_dim, layer_type)
        if long is not None:  # Phi-3: long factors from the original length on, scaled
            long_inv, orig, scale = long
            pos = torch.arange(orig, max(orig, max_positions), dtype=torch.int64,
                               device=inv.device).float()
            freqs[orig:] = pos[:, None] * long_inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, head_dim]
        # transformers scales cos and sin in float32 (longrope's attention factor).
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
