"""The decoder every supported family shares: pre-norm layers of attention (packed QKV,
rotary, paged KV) and a SwiGLU MLP (packed gate/up), KV-stateless.

``forward(input_ids, positions, meta, kv_caches)`` takes everything a step needs
explicitly; the model holds weights only. Q/K/V and gate/up projections are
packed into one weight each (the loader concatenates the checkpoint's tensors).
The arithmetic follows transformers' reference implementation operation by
operation so that float32 logits agree to rounding.

A family (``llama.py``, ``qwen3.py``, ...) is a subclass that sets ``traits``: what
it does differently from Llama, read here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.config import ModelConfig
from conveyor.distributed.parallel import SINGLE, TPShard
from conveyor.model.attention.metadata import AttentionMetadata
from conveyor.model.attention.paged import paged_attention
from conveyor.model.layers.embedding import VocabParallelEmbedding
from conveyor.model.layers.norm import RMSNorm
from conveyor.model.layers.ops import TorchOps
from conveyor.model.layers.rotary import RotaryEmbedding
from conveyor.model.linear.packing import pack_linears, pack_linears_by, packed_linear
from conveyor.model.linear.registry import linear_backends
from conveyor.model.linear.shape import LinearShape


@dataclass(frozen=True)
class FamilyTraits:
    """How a family departs from Llama's decoder."""

    qkv_bias: bool = False  # QKV has a bias even where config.json's attention_bias is unset
    qk_norm: bool = False  # per-head RMS norms of q and k, before the rotation
    sliding_window: bool = False  # use_sliding_window's default where config.json omits it


class Attention(nn.Module):
    """Under tensor parallelism a rank holds some heads (``TPShard.heads``): QKV is
    column-parallel, o_proj row-parallel and all-reduced."""

    def __init__(self, cfg: ModelConfig, traits: FamilyTraits, tp: TPShard = SINGLE
                 ) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.tp = tp
        split = tp.heads(cfg.num_heads, cfg.num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            split.num_heads, split.num_kv_heads, cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(hf.get("attention_bias", False)) or traits.qkv_bias
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.qk_norm = traits.qk_norm
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
    def __init__(self, cfg: ModelConfig, traits: FamilyTraits, tp: TPShard = SINGLE) -> None:
        super().__init__()
        eps = cfg.hf_config.get("rms_norm_eps", 1e-6)
        self.self_attn = Attention(cfg, traits, tp)
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


class DecoderForCausalLM(nn.Module):
    """The shared decoder with its LM head; a family's module subclasses it."""

    traits: ClassVar[FamilyTraits] = FamilyTraits()

    def __init__(self, cfg: ModelConfig, tp: TPShard = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        hf = cfg.hf_config
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.traits, tp)
                                    for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, hf.get("rms_norm_eps", 1e-6))
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        if not self.tie_word_embeddings:  # this rank's vocabulary rows, as the embedding's
            self.lm_head = nn.Linear(cfg.hidden_size, tp.vocab_shard(cfg.vocab_size),
                                     bias=False)
        self.rope = RotaryEmbedding(hf, cfg.head_dim, cfg.max_position_embeddings)
        window = hf.get("sliding_window")
        use_window = hf.get("use_sliding_window", self.traits.sliding_window)
        self.sliding_window: int | None = int(window) if window and use_window else None
        # Elementwise steps: reference PyTorch ops unless the runner installs native ones.
        self.ops: TorchOps = TorchOps()
        self.packed_lm_head: nn.Module | None = None

    def pack_linears(self, backend: str = "onednn") -> int:
        """Pre-pack every projection and the LM head for ``backend`` (a linear backend that
        packs, see ``linear/registry.py``); returns how many weights were packed."""
        self.packed_lm_head = packed_linear(self.lm_head_weight, None, backend)
        if not self.tie_word_embeddings:
            del self.lm_head
        return pack_linears(self.layers, backend) + 1

    def pack_linears_by_shape(self, choice: dict[str, str], few_rows: int = 0,
                              lib=None) -> int:
        """Pack each projection with the backend ``choice`` names for its shape (keys of
        ``LinearShape``: measured per machine); returns how many were packed.
        ``few_rows``: calls of up to that many rows to conveyor's GEMM
        (``linear/few_rows.py``)."""
        head = LinearShape(*self.lm_head_weight.shape, lm_head=True).key
        count = 0
        if linear_backends.get(choice[head]).packs:
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
