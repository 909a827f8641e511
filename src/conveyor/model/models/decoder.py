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
    # Gemma: RMS norms scale by (1 + w) (the loader folds the 1 into w, ``after_load``).
    norm_plus_one: bool = False
    # Gemma 2/3: norms after attention and the MLP too, besides the pre-norms.
    sandwich_norms: bool = False
    # OLMo 2: norms after attention and the MLP only (no pre-norm); q/k norms over all heads.
    post_norms_only: bool = False
    qk_norm_full: bool = False
    embed_scale_sqrt: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    # Gemma 3: sliding layers rotate with their own rope (``rope_parameters``' local base).
    local_rope: bool = False


class Attention(nn.Module):
    """Under tensor parallelism a rank holds some heads (``TPShard.heads``): QKV is
    column-parallel, o_proj row-parallel and all-reduced."""

    def __init__(self, cfg: ModelConfig, traits: FamilyTraits, tp: TPShard = SINGLE,
                 window: int | None = None) -> None:
        super().__init__()
        hf = cfg.hf_config
        self.tp = tp
        self.window = window  # this layer's sliding window (None: full attention)
        # Set by the model when its layers' windows differ: read the step's view of ours.
        self.mixed_windows = False
        cap = hf.get("attn_logit_softcapping")
        self.softcap: float | None = float(cap) if cap else None
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
        self.qk_norm_full = traits.qk_norm_full
        if self.qk_norm_full:  # OLMo 2: one norm over all heads
            # Under TP a rank holds its heads' slice of each norm's weight; the mean square
            # is over every head: the ranks' sums of squares are all-reduced, a KV head
            # held by several ranks (more ranks than KV heads) counted once.
            eps = hf.get("rms_norm_eps", 1e-6)
            self.q_norm = RMSNorm(self.q_size, eps)
            self.k_norm = RMSNorm(self.kv_size, eps)
            self.qk_full = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
            self.k_copies = max(1, tp.world_size // cfg.num_kv_heads)
        self.scale = self.head_dim ** -0.5
        if hf.get("query_pre_attn_scalar"):  # Gemma
            self.scale = float(hf["query_pre_attn_scalar"]) ** -0.5
        if hf.get("attention_multiplier") is not None:  # Granite
            self.scale = float(hf["attention_multiplier"])

    def _sharded_qk_norms(self, q: torch.Tensor, k: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm's arithmetic over the whole q and k rows from this rank's slices: one
        all-reduce of both rows' sums of squares."""
        q32, k32 = q.float(), k.float()
        sums = torch.stack([q32.pow(2).sum(-1), k32.pow(2).sum(-1)], dim=-1)
        self.tp.all_reduce(sums)
        q_full, k_full = self.qk_full
        out = []
        for x, x32, norm, var in ((q, q32, self.q_norm, sums[:, :1] / q_full),
                                  (k, k32, self.k_norm, sums[:, 1:] / self.k_copies / k_full)):
            out.append(norm.weight * (x32 * torch.rsqrt(var + norm.eps)).to(x.dtype))
        return out[0], out[1]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor],
                ops: TorchOps) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q + 2 kv]
        if self.qk_norm_full:  # norms over the whole q and k rows, before the rotation
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            if self.tp.enabled:
                q, k = self._sharded_qk_norms(q, k)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
            q, k = rope(positions, q, k)
            v = v.view(t, self.num_kv_heads, self.head_dim)
        elif self.qk_norm:  # per-head norms come before the rotation
            q, k, v = ops.head_norms_rope_(rope, positions, qkv, self.q_norm, self.k_norm,
                                           self.num_heads, self.num_kv_heads, self.head_dim)
        else:
            q, k, v = ops.rope_(rope, positions, qkv, self.num_heads, self.num_kv_heads,
                                self.head_dim)
        if self.mixed_windows:
            meta = meta.for_window(self.window)
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
                            self.softcap)
        return self.tp.all_reduce(self.o_proj(o.reshape(t, self.q_size)))


class MLP(nn.Module):
    """``intermediate`` is this rank's share: gate/up column-parallel, down row-parallel."""

    def __init__(self, hidden: int, intermediate: int, act: str, tp: TPShard = SINGLE
                 ) -> None:
        super().__init__()
        self.tp = tp
        if act not in ("silu", "swish", *GELU_TANH):
            raise ValueError(f"unsupported activation {act!r} (gated MLPs with silu or "
                             f"{', '.join(GELU_TANH)} only)")
        # Packers fuse silu(gate) * up into gate_up_proj only where this is True.
        self.fuses_silu = act not in GELU_TANH
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if not self.fuses_silu:  # GeGLU (Gemma): gelu-tanh(gate) * up
            h = ops.gelu_tanh_mul(h, self.intermediate)
        elif not getattr(self.gate_up_proj, "applies_silu_mul", False):  # else fused in
            h = ops.silu_mul(h, self.intermediate)
        return self.tp.all_reduce(self.down_proj(h))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, traits: FamilyTraits, tp: TPShard = SINGLE,
                 window: int | None = None, mlp: nn.Module | None = None) -> None:
        super().__init__()
        hf = cfg.hf_config
        eps = hf.get("rms_norm_eps", 1e-6)
        self.self_attn = Attention(cfg, traits, tp, window)
        self.mlp = mlp if mlp is not None else MLP(
            cfg.hidden_size, tp.intermediate(cfg.intermediate_size),
            hf.get("hidden_activation") or hf.get("hidden_act", "silu"), tp)
        self.layout = ("sandwich" if traits.sandwich_norms
                       else "post" if traits.post_norms_only else "pre")
        if self.layout != "post":
            self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        if self.layout != "pre":
            if self.layout == "sandwich":
                self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps)
        # Granite: each sublayer's output is scaled before it joins the residual stream.
        mult = hf.get("residual_multiplier")
        self.residual_multiplier: float | None = float(mult) if mult is not None else None

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rope: RotaryEmbedding, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor], ops: TorchOps
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm layer with the residual stream carried separately (as transformers adds
        it: residual + sublayer output), so each add fuses with the next norm."""
        if self.layout != "pre":
            return self._forward_post_norms(h, residual, positions, rope, meta, kv_cache,
                                            ops)
        if residual is None:
            residual = h
            x = ops.rms_norm(h, self.input_layernorm)
        else:
            x, residual = ops.add_rms_norm(h, residual, self.input_layernorm)
        a = self.self_attn(x, positions, rope, meta, kv_cache, ops)
        if self.residual_multiplier is not None:
            a = a * self.residual_multiplier
        x, residual = ops.add_rms_norm(a, residual, self.post_attention_layernorm)
        m = self.mlp(x, ops)
        if self.residual_multiplier is not None:
            m = m * self.residual_multiplier
        return m, residual

    def _forward_post_norms(self, h: torch.Tensor, residual: torch.Tensor | None,
                            positions: torch.Tensor, rope: RotaryEmbedding,
                            meta: AttentionMetadata,
                            kv_cache: tuple[torch.Tensor, torch.Tensor], ops: TorchOps
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gemma's sandwich (pre- and post-norms around both sublayers) and OLMo 2's
        post-norms only: each sublayer's output is normed before it joins the residual."""
        if residual is None:
            residual = h
            x = ops.rms_norm(h, self.input_layernorm) if self.layout == "sandwich" else h
        elif self.layout == "sandwich":
            x, residual = ops.add_rms_norm(h, residual, self.input_layernorm)
        else:
            residual = residual + h
            x = residual
        a = ops.rms_norm(self.self_attn(x, positions, rope, meta, kv_cache, ops),
                         self.post_attention_layernorm)
        if self.layout == "sandwich":
            x, residual = ops.add_rms_norm(a, residual, self.pre_feedforward_layernorm)
        else:
            residual = residual + a
            x = residual
        return ops.rms_norm(self.mlp(x, ops), self.post_feedforward_layernorm), residual


class DecoderForCausalLM(nn.Module):
    """The shared decoder with its LM head; a family's module subclasses it."""

    traits: ClassVar[FamilyTraits] = FamilyTraits()

    def __init__(self, cfg: ModelConfig, tp: TPShard = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        hf = cfg.hf_config
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layer_windows = layer_windows(hf, cfg.num_layers, self.traits.sliding_window,
                                           self.layer_types(hf, cfg.num_layers))
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.traits, tp, self.layer_windows[i], self.make_mlp(i))
            for i in range(cfg.num_layers))
        mixed = len(set(self.layer_windows)) > 1
        for layer in self.layers:
            layer.self_attn.mixed_windows = mixed
        # Granite's embedding multiplier, Gemma's sqrt(hidden) (rounded to the weights'
        # dtype as transformers does), applied after the lookup; None: neither.
        self.embed_scale: float | None = (
            cfg.hidden_size ** 0.5 if self.traits.embed_scale_sqrt
            else hf.get("embedding_multiplier"))
        cap = hf.get("final_logit_softcapping")
        self.final_softcap: float | None = float(cap) if cap else None  # Gemma 2
        scaling = hf.get("logits_scaling")
        self.logits_scaling: float | None = float(scaling) if scaling else None  # Granite
        self.norm = RMSNorm(cfg.hidden_size, hf.get("rms_norm_eps", 1e-6))
        self.tie_word_embeddings = bool(hf.get("tie_word_embeddings", False))
        if not self.tie_word_embeddings:  # this rank's vocabulary rows, as the embedding's
            self.lm_head = nn.Linear(cfg.hidden_size, tp.vocab_shard(cfg.vocab_size),
                                     bias=False)
        self.rope = RotaryEmbedding(hf, cfg.head_dim, cfg.max_position_embeddings)
        # Gemma 3's sliding layers rotate with the local base (rebuilt in after_load).
        self.local_rope: RotaryEmbedding | None = (
            RotaryEmbedding(hf, cfg.head_dim, cfg.max_position_embeddings,
                            "sliding_attention") if self.traits.local_rope else None)
        # One window for every layer (the runner's decode starts and prefill masks), else
        # None: then the runner builds a view per window (``AttentionMetadata.by_window``).
        self.sliding_window: int | None = None if mixed else self.layer_windows[0]
        # Elementwise steps: reference PyTorch ops unless the runner installs native ones.
        self.ops: TorchOps = TorchOps()
        self.packed_lm_head: nn.Module | None = None

    @classmethod
    def layer_types(cls, hf: dict, num_layers: int) -> list[str] | None:
        """Each layer's ``sliding_attention`` or ``full_attention``: config.json's
        ``layer_types`` (a family may know its pattern where an older config omits it)."""
        return hf.get("layer_types")

    def make_mlp(self, layer: int) -> nn.Module | None:
        """Layer ``layer``'s feed-forward block, or None for the shared gated MLP (a
        mixture-of-experts family returns its sparse block)."""
        return None

    @property
    def native_draft_ok(self) -> bool:
        """Whether the native draft loop (``kernels/cpu/ops.DraftForward``, Llama's
        arithmetic) computes this model: not with the newer families' differences."""
        t = self.traits
        return not (t.norm_plus_one or t.sandwich_norms or t.post_norms_only
                    or t.qk_norm_full or t.embed_scale_sqrt or t.local_rope
                    or self.embed_scale is not None or self.logits_scaling is not None
                    or self.final_softcap is not None
                    or any(lay.residual_multiplier is not None or lay.self_attn.softcap
                           or type(lay.mlp) is not MLP or not lay.mlp.fuses_silu
                           for lay in self.layers))

    def after_load(self, device: torch.device) -> None:
        """Once the weights are in: Gemma's (1 + w) norms folded into w (a plain RMS norm
        then, for every ops backend: float32 (1 + w) as transformers computes it), the
        local rope's tables rebuilt on the device."""
        if self.traits.norm_plus_one:
            with torch.no_grad():
                for module in self.modules():
                    if isinstance(module, RMSNorm):
                        module.weight.add_(1.0)
        if self.local_rope is not None:
            self.local_rope = RotaryEmbedding(self.cfg.hf_config, self.cfg.head_dim,
                                              self.cfg.max_position_embeddings,
                                              "sliding_attention").to(device)

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
        if self.traits.embed_scale_sqrt:  # Gemma: the scale rounded to h's dtype first
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        elif self.embed_scale is not None:  # Granite: a Python float, as transformers'
            h = h * self.embed_scale
        residual = None
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            rope = (self.local_rope if self.local_rope is not None
                    and layer.self_attn.window is not None else self.rope)
            h, residual = layer(h, residual, positions, rope, meta, kv, self.ops)
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
        if self.logits_scaling is not None:  # Granite: elementwise, so per shard
            local = local / self.logits_scaling
        if self.final_softcap is not None:  # Gemma 2 (local is this step's own tensor)
            local = self.ops.softcap(local, self.final_softcap)
        return self.tp.gather_vocab(local, self.cfg.vocab_size)


# Gemma's activation under its names in config.json (transformers' ``ACT2FN``).
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def layer_windows(hf: dict, num_layers: int, default_on: bool,
                  types: list[str] | None) -> list[int | None]:
    """Each layer's sliding window: config.json's ``sliding_window`` where windows are on
    (``use_sliding_window``, else the family's default), on the layers ``types`` marks
    ``sliding_attention`` (every layer where there are none)."""
    window = hf.get("sliding_window")
    if not window or not hf.get("use_sliding_window", default_on):
        return [None] * num_layers
    if not types:
        return [int(window)] * num_layers
    return [int(window) if types[i] == "sliding_attention" else None
            for i in range(num_layers)]
