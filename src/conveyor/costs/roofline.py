"""Roofline cost model: a step costs max(compute time, memory time), from shapes alone.

Per step, with T tokens computed (prefill chunks plus one per decode), S rows
sampled, P query-key pairs of attention and C KV tokens read, on ``tp`` devices:

    FLOPs  = 2 * L * W_layer * T           linear layers (W_layer: matmul weights/layer)
           + 2 * H * V * S                 LM head, only on the rows that sample
           + 4 * L * n_heads * d_head * P  attention scores and weighted sum
    bytes  = weights                       every weight read once per step
           + T * H * b                     embedding rows
           + (C + T) * kv_bytes_per_token  KV read (context) and written (new tokens)

    step = max(FLOPs / tp / (peak * compute_efficiency),
               bytes_per_device / (bandwidth * memory_efficiency))
         + all_reduce + step_overhead

Activations are not counted as memory traffic (they are small next to weights and
KV at serving batch sizes). With ``tp`` > 1 every weight matrix and the KV heads
are split across devices (KV heads replicated when there are fewer than ``tp``),
and each layer adds two ring all-reduces of the T x H activations:
``latency + 2 (tp-1)/tp * T*H*b / interconnect``, not overlapped with compute.

The KV pool is what is left of ``memory * memory_utilization`` per device after
that device's share of the weights.

A mixture of experts (E experts of intermediate I, top-k) is costed by its active
parameters: a token's FLOPs count its k experts (and the router), not all E; the bytes
count the experts a step's T tokens touch, E * (1 - (1 - k/E)^T) of them in expectation
under uniform routing (k at one token, all E soon after), every other weight once.
"""

from __future__ import annotations

from dataclasses import dataclass

from conveyor.config import ModelConfig
from conveyor.costs.hardware import HardwareSpec
from conveyor.costs.shape import BatchShape


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    qk_norm: bool
    dtype_bytes: int
    # A mixture of experts: E experts of intermediate ``expert_intermediate``, top-k each
    # token (0: a dense MLP of ``intermediate``).
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    # Norm weights a layer has beyond two hidden-wide norms and per-head q/k norms
    # (Gemma's post-norms, OLMo 2's q/k norms over all heads).
    extra_norm_params: int = 0

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> ModelShape:
        hf = cfg.hf_config
        return cls(num_layers=cfg.num_layers, hidden=cfg.hidden_size, num_heads=cfg.num_heads,
                   num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                   intermediate=cfg.intermediate_size, vocab=cfg.vocab_size,
                   tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
                   attention_bias=bool(hf.get("attention_bias",
                                              cfg.architecture == "Qwen2ForCausalLM")),
                   mlp_bias=bool(hf.get("mlp_bias", False)),
                   qk_norm=cfg.architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                                                "Gemma3ForCausalLM"),
                   dtype_bytes=4 if cfg.dtype == "float32" else 2, **_experts(hf),
                   extra_norm_params=_extra_norms(cfg))

    @property
    def layer_matmul_params(self) -> int:
        """Every matmul weight of a layer (all experts of a MoE)."""
        if self.num_experts:
            return self._attention_params + self.num_experts * (
                self.hidden + self.expert_params)
        return self._attention_params + 3 * self.hidden * self.intermediate

    @property
    def active_layer_matmul_params(self) -> int:
        """The matmul weights one token multiplies in a layer (its k experts, the router)."""
        if self.num_experts:
            return (self._attention_params + self.num_experts * self.hidden
                    + self.experts_per_token * self.expert_params)
        return self.layer_matmul_params

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_intermediate

    @property
    def _attention_params(self) -> int:
        q, kv, h = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.hidden
        return h * q + 2 * h * kv + q * h

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct experts a layer runs for ``tokens`` tokens (uniform routing)."""
        e, k = self.num_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** tokens) if e else 0.0

    @property
    def layer_other_params(self) -> int:
        """Norms and biases: no matmul FLOPs, but weights all the same."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        n = 2 * self.hidden
        if self.attention_bias:
            n += q + 2 * kv
        if self.mlp_bias:
            n += 2 * self.intermediate + self.hidden
        if self.qk_norm:
            n += 2 * self.head_dim
        return n + self.extra_norm_params

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def num_params(self) -> int:
        """Every parameter, as transformers counts them (tied embeddings once)."""
        lm_head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return (self.num_layers * (self.layer_matmul_params + self.layer_other_params)
                + self.embedding_params + lm_head + self.hidden)

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """KV bytes per token on one device of ``tp`` (heads split, replicated if too few)."""
        heads = -(-self.num_kv_heads // tp)
        return 2 * self.num_layers * heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class RooflineBreakdown:
    """One step's roofline terms (``RooflineCostModel.cost``): what bounds it, and by how
    much."""

    flops: float  # whole step, all devices
    bytes_per_device: float
    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float

    @property
    def total_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.comm_s + self.overhead_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


class RooflineCostModel:
    """A ``MachineCostModel`` (``conveyor.costs.protocol``) from shapes alone."""

    def __init__(self, model: ModelConfig, hardware: HardwareSpec, tp: int = 1) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        if tp > 1 and hardware.interconnect_gbps <= 0:
            raise ValueError(f"hardware {hardware.name!r} has no interconnect_gbps: it cannot "
                             f"model tensor parallelism (tp={tp})")
        self.model = model
        self.shape = ModelShape.from_config(model)
        self.hw = hardware
        self.tp = tp
        self.cap_kv_to_useful = hardware.device_type == "cpu"
        s = self.shape
        self._flops_per_token = 2.0 * s.num_layers * s.active_layer_matmul_params
        self._flops_per_sample = 2.0 * s.hidden * s.vocab
        self._flops_per_pair = 4.0 * s.num_layers * s.num_heads * s.head_dim
        # Every weight is streamed once per step except an untied embedding table, of which
        # only the T rows looked up are read (a tied one is streamed as the LM head).
        untied_embedding = 0 if s.tied_embeddings else s.embedding_params * s.dtype_bytes
        self._weight_bytes = (s.weight_bytes - untied_embedding) / tp
        # A MoE's experts are in _weight_bytes only as far as a step's tokens touch them.
        self._expert_bytes = s.num_layers * s.expert_params * s.dtype_bytes / tp
        self._weight_bytes -= self._expert_bytes * s.num_experts
        self._embed_row_bytes = s.hidden * s.dtype_bytes / tp
        self._kv_bytes = s.kv_bytes_per_token(tp)
        self._flops_per_s = tp * hardware.peak_flops(model.dtype) * hardware.compute_efficiency
        self._bytes_per_s = hardware.memory_bandwidth_gbps * 1e9 * hardware.memory_efficiency
        self._overhead_s = hardware.step_overhead_ms * 1e-3
        if tp > 1:
            self._ar_latency = hardware.allreduce_latency_us * 1e-6
            self._ar_s_per_token = (2 * (tp - 1) / tp * s.hidden * s.dtype_bytes
                                    / (hardware.interconnect_gbps * 1e9))
        else:
            self._ar_latency = self._ar_s_per_token = 0.0

    def cost(self, b: BatchShape) -> RooflineBreakdown:
        tokens = b.num_prefill_tokens + b.num_decodes
        flops = (self._flops_per_token * tokens + self._flops_per_sample * b.num_sampled
                 + self._flops_per_pair * (b.prefill_attention + b.decode_context))
        nbytes = (self._weight_bytes + self._embed_row_bytes * tokens
                  + self._kv_bytes * (b.prefill_context + b.decode_context + tokens)
                  + self._expert_bytes * self.shape.experts_touched(tokens))
        comm = 2 * self.shape.num_layers * (self._ar_latency + self._ar_s_per_token * tokens) \
            if self.tp > 1 else 0.0
        return RooflineBreakdown(flops, nbytes, flops / self._flops_per_s,
                                 nbytes / self._bytes_per_s, comm, self._overhead_s)

    def step_time(self, b: BatchShape) -> float:
        # cost(b).total_s without building a RooflineBreakdown (this runs every simulated step).
        tokens = b.num_prefill_tokens + b.num_decodes
        compute = (self._flops_per_token * tokens + self._flops_per_sample * b.num_sampled
                   + self._flops_per_pair * (b.prefill_attention + b.decode_context)
                   ) / self._flops_per_s
        memory = (self._weight_bytes + self._embed_row_bytes * tokens
                  + self._kv_bytes * (b.prefill_context + b.decode_context + tokens)
                  + self._expert_bytes * self.shape.experts_touched(tokens)
                  ) / self._bytes_per_s
        comm = 2 * self.shape.num_layers * (self._ar_latency + self._ar_s_per_token * tokens) \
            if self.tp > 1 else 0.0
        return max(compute, memory) + comm + self._overhead_s

    def kv_cache_memory(self, model: ModelConfig) -> int:
        """Logical KV bytes (as ``kv_cache_memory``) that fit beside the weights."""
        per_device = self.hw.memory_bytes * self.hw.memory_utilization \
            - self.shape.weight_bytes / self.tp
        if per_device <= 0:
            raise ValueError(
                f"{model.served_model_name}: {self.shape.weight_bytes / self.tp / 2**30:.1f} "
                f"GiB of weights per device do not fit in {self.hw.memory_gib:g} GiB x "
                f"{self.hw.memory_utilization:g} of {self.hw.name} with tp={self.tp}; "
                "raise --tp")
        tokens = int(per_device // self.shape.kv_bytes_per_token(self.tp))
        return tokens * model.kv_bytes_per_token

    def describe(self) -> str:
        hw = self.hw
        return (f"roofline {hw.name} x tp{self.tp} ({hw.peak_tflops:g} TFLOP/s x "
                f"{hw.compute_efficiency:g}, {hw.memory_bandwidth_gbps:g} GB/s x "
                f"{hw.memory_efficiency:g}, {hw.step_overhead_ms:g} ms/step)")


def _experts(hf: dict) -> dict[str, int]:
    """A mixture of experts' shape from config.json (Mixtral's ``num_local_experts``,
    Qwen3-MoE's ``num_experts`` and ``moe_intermediate_size``); empty for a dense model."""
    experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
    if not experts:
        return {}
    return {"num_experts": experts, "experts_per_token": int(hf.get("num_experts_per_tok", 2)),
            "expert_intermediate": int(hf.get("moe_intermediate_size")
                                       or hf["intermediate_size"])}


def _extra_norms(cfg: ModelConfig) -> int:
    if cfg.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        return 2 * cfg.hidden_size  # pre- and post-feedforward norms
    if cfg.architecture == "Olmo2ForCausalLM":
        return (cfg.num_heads + cfg.num_kv_heads) * cfg.head_dim
    return 0
