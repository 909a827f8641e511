"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3), KV-stateless.

``forward(input_ids, positions, meta, kv_caches)`` takes everything a step needs
explicitly; the model holds weights only. Q/K/V and gate/up projections are
packed into one weight each (the loader concatenates the checkpoint's tensors).
The arithmetic follows transformers' reference implementation operation by
operation so that float32 logits agree to rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.config import ModelConfig
from conveyor.distributed.parallel import SINGLE, TPShard
from conveyor.model.attention import AttentionMetadata, paged_attention
from conveyor.model.layer_ops import TorchOps
from conveyor.model.packed_linear import pack_linears, packed_linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(hf: dict, head_dim: int) -> torch.Tensor:
    """Inverse frequencies with the checkpoint's rope scaling (default, linear, llama3)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = hf.get("rope_scaling") or {}
    params = {**scaling, **params}
    base = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "default":
        return inv
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
    raise ValueError(f"unsupported rope type {rope_type!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a precomputed cos/sin table."""

    def __init__(self, hf: dict, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv = rope_inv_freq(hf, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_pos, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Under tensor parallelism a rank holds some heads (``TPShard.heads``): QKV is
    column-parallel, o_proj row-parallel and all-reduced."""

    def __init__(self, cfg: ModelConfig, tp: TPShard = SINGLE) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.tp = tp
        split = tp.heads(cfg.num_heads, cfg.num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            split.num_heads, split.num_kv_heads, cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(hf.get("attention_bias", False)) or cfg.architecture == "Qwen2ForCausalLM"
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.architecture == "Qwen3ForCausalLM"
        if self.qk_norm:
            eps = hf.get("rms_norm_eps", 1e-6)
            self.q_norm = RMSNorm(self.head_dim, eps)
            self.k_norm = RMSNorm(self.head_dim, eps)
        self.scale = self.head_dim ** -0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor],
                ops: TorchOps) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q + 2 kv]
        if self.qk_norm:  # per-head norms come before the rotation (reference ops)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
            k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
            q, k = rope(positions, q, k)
            v = v.view(t, self.num_kv_heads, self.head_dim)
        else:
            q, k, v = ops.rope_(rope, positions, qkv, self.num_heads, self.num_kv_heads,
                                self.head_dim)
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.tp.all_reduce(self.o_proj(o.reshape(t, self.q_size)))


class MLP(nn.Module):
    """``intermediate`` is this rank's share: gate/up column-parallel, down row-parallel."""

    def __init__(self, hidden: int, intermediate: int, act: str, tp: TPShard = SINGLE
                 ) -> None:
        super().__init__()
        self.tp = tp
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported activation {act!r} (SwiGLU with silu only)")
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if not getattr(self.gate_up_proj, "applies_silu_mul", False):  # else fused in
            h = ops.silu_mul(h, self.intermediate)
        return self.tp.all_reduce(self.down_proj(h))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPShard = SINGLE) -> None:
        super().__init__()
        eps = cfg.hf_config.get("rms_norm_eps", 1e-6)
        self.self_attn = Attention(cfg, tp)
        self.mlp = MLP(cfg.hidden_size, tp.intermediate(cfg.intermediate_size),
                       cfg.hf_config.get("hidden_act", "silu"), tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rope: RotaryEmbedding, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor], ops: TorchOps
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm layer with the residual stream carried separately (as transformers adds
        it: residual + sublayer output), so each add fuses with the next norm."""
        if residual is None:
            residual = h
            x = ops.rms_norm(h, self.input_layernorm)
        else:
            x, residual = ops.add_rms_norm(h, residual, self.input_layernorm)
        a = self.self_attn(x, positions, rope, meta, kv_cache, ops)
        x, residual = ops.add_rms_norm(a, residual, self.post_attention_layernorm)
        return self.mlp(x, ops), residual


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + shard)`` of the vocabulary (zero rows past its end); a token
    outside them embeds to zeros here and the all-reduce brings its row from its rank."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPShard = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        shard = tp.vocab_shard(vocab_size)
        self.start = tp.rank * shard
        self.weight = nn.Parameter(torch.empty(shard, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0.0))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPShard = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        hf = cfg.hf_config
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, hf.get("rms_norm_eps", 1e-6))
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        if not self.tie_word_embeddings:  # this rank's vocabulary rows, as the embedding's
            self.lm_head = nn.Linear(cfg.hidden_size, tp.vocab_shard(cfg.vocab_size),
                                     bias=False)
        self.rope = RotaryEmbedding(hf, cfg.head_dim, cfg.max_position_embeddings)
        window = hf.get("sliding_window")
        use_window = hf.get("use_sliding_window", cfg.architecture == "MistralForCausalLM")
        self.sliding_window: int | None = int(window) if window and use_window else None
        # Elementwise steps: reference PyTorch ops unless the runner installs native ones.
        self.ops: TorchOps = TorchOps()
        self.packed_lm_head: nn.Module | None = None

    def pack_linears(self, backend: str = "onednn") -> int:
        """Pre-pack every projection and the LM head for ``backend`` (native or onednn, see
        packed_linear.py); returns how many weights were packed."""
        self.packed_lm_head = packed_linear(self.lm_head_weight, None, backend)
        if not self.tie_word_embeddings:
            del self.lm_head
        return pack_linears(self.layers, backend) + 1

    def pack_linears_by_shape(self, choice: dict[str, str], few_rows: int = 0,
                              lib=None) -> int:
        """Pack each projection with the backend ``choice`` names for its shape (keys of
        ``linear_choice.LinearShape``: measured per machine); returns how many were packed.
        ``few_rows``: calls of up to that many rows to conveyor's GEMM (``few_rows.py``)."""
        from conveyor.model.backends import linear_backend
        from conveyor.model.linear_choice import LinearShape
        from conveyor.model.packed_linear import pack_linears_by

        head = LinearShape(*self.lm_head_weight.shape, lm_head=True).key
        count = 0
        if linear_backend(choice[head]).packs:
            self.packed_lm_head = packed_linear(self.lm_head_weight, None, choice[head])
            if not self.tie_word_embeddings:
                del self.lm_head
            count = 1
        return count + pack_linears_by(self.layers, lambda name, w: choice[LinearShape(
            *w.shape, gate_up=name == "gate_up_proj").key], few_rows, lib)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.packed_lm_head is not None:
            raise RuntimeError("the LM head is packed: no plain weight")
        return self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions: [T]. Returns final hidden states [T, hidden]."""
        h = self.embed_tokens(input_ids)
        residual = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, positions, self.rope, meta, kv, self.ops)
        if residual is None:
            return self.ops.rms_norm(h, self.norm)
        return self.ops.add_rms_norm(h, residual, self.norm)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, vocab]: this rank's vocabulary slice, all-gathered under TP (every rank then
        holds the same logits and samples the same tokens)."""
        if self.packed_lm_head is not None:
            local = self.packed_lm_head(hidden)
        else:
            local = F.linear(hidden, self.lm_head_weight)
        return self.tp.gather_vocab(local, self.cfg.vocab_size)
