"""The sparse mixture-of-experts block (Mixtral, Qwen3-MoE): a router picks each token's
top-k experts, each expert a gated (SwiGLU) MLP, the outputs summed by the router's
weights.

Experts run grouped by expert, not token by token: the (token, expert) pairs are sorted
by expert, and each active expert multiplies all of its tokens' rows at once (one GEMM
for gate/up, one for down); the weighted outputs are added back into their tokens' rows
expert after expert, in ascending expert order as transformers adds them, so the sums
round alike.

Each expert's projections are ``nn.Linear``s (``experts.E.gate_up_proj``, gate rows then
up rows, and ``experts.E.down_proj``), so the linear backends pack them like any other
projection (oneDNN, conveyor's GEMM with silu(gate) * up fused in, measured per shape):
``torch._grouped_mm`` runs on CPU but measured no faster than one GEMM per active expert
(docs/results). Where every expert's projections are conveyor's GEMM (``NativeLinear``,
gate/up with silu fused), a step's experts run in two native calls instead
(``GroupedGemm``: all gate/ups in one parallel region, then all downs), the threads
taking runs of an expert's output panels in turn: at decode sizes an expert has a few
rows, and a parallel region per expert's GEMM cost more than splitting its work saved;
each row comes out the same bits as the expert's own GEMM gives it. Around them, in
float32, the routing after the router's softmax (top-k, renormalising, grouping by expert,
gathering the rows) and the weighted sum are one native call each (``moe_route.c``): at
decode sizes the dozen torch ops they replace cost more than the block's routing work.
They compute torch's bits and decline where torch's own order would decide (a tie at a
row's k-th probability); the torch ops below then run. The loader fills them
from either checkpoint layout (stacked, or one tensor per expert) in place. Under tensor parallelism
a rank holds every expert's slice of the intermediate dimension (its rows of gate and
up, its columns of down) and the block's output is all-reduced; the router is replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.distributed.parallel import SINGLE, TPShard


class Expert(nn.Module):
    """One expert: packed gate/up and down projections (``MLP``'s names, so the packers
    treat it alike)."""

    fuses_silu = True

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if not getattr(self.gate_up_proj, "applies_silu_mul", False):  # else fused in
            h = ops.silu_mul(h, self.intermediate) if ops is not None else (
                F.silu(h[:, :self.intermediate]) * h[:, self.intermediate:])
        return self.down_proj(h)


class SparseMoE(nn.Module):
    """``renormalize``: the top-k weights divided by their sum (Mixtral; Qwen3-MoE's
    ``norm_topk_prob``), else the softmax's values as they are. ``float32_weights``: the
    expert outputs are scaled by float32 weights and rounded after (Mixtral), else by
    weights rounded to the activations' dtype first (Qwen3-MoE), as each one's
    transformers code does (the same in float32)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 renormalize: bool, act: str = "silu", tp: TPShard = SINGLE,
                 float32_weights: bool = False) -> None:
        super().__init__()
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported expert activation {act!r} (SwiGLU with silu only)")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..{num_experts}")
        self.tp = tp
        self.hidden, self.intermediate = hidden, intermediate  # this rank's intermediate
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.float32_weights = float32_weights
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(Expert(hidden, intermediate) for _ in range(num_experts))
        # The experts' GEMMs grouped (gate/up, down), built on the first call after the
        # backends packed them; keyed by expert 0's gate/up module (a repack rebuilds).
        self._grouped: tuple | None = None
        self._grouped_key: nn.Module | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) as transformers computes them: softmax in
        float32, top-k, optionally renormalized."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float32_weights else weights.to(x.dtype)), experts

    def grouped_gemms(self) -> tuple | None:
        """(gate/up, down) ``GroupedGemm``s over every expert, or None where an expert's
        projection is not conveyor's float32-input GEMM with silu fused into gate/up."""
        key = self.experts[0].gate_up_proj
        if self._grouped_key is not key:
            from conveyor.kernels.cpu.ops import GroupedGemm
            from conveyor.model.linear.native import NativeLinear

            gate_ups = [e.gate_up_proj for e in self.experts]
            downs = [e.down_proj for e in self.experts]
            ok = (all(isinstance(m, NativeLinear) for m in gate_ups + downs)
                  and all(m.applies_silu_mul for m in gate_ups)
                  and not any(m.applies_silu_mul or m.bias is not None for m in downs))
            try:
                self._grouped = (GroupedGemm([m.gemm for m in gate_ups]),
                                 GroupedGemm([m.gemm for m in downs])) if ok else None
            except ValueError:  # mixed weight dtypes: one GEMM per expert
                self._grouped = None
            self._grouped_key = key
        return self._grouped

    def group(self, weights: torch.Tensor, experts: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The (slot, token) pairs grouped by expert, each expert's rows in transformers'
        order (by slot, then token: a GEMM's last rows may round otherwise than its
        first): (token of each pair [T k], its weight [T k], expert starts int32 [E + 1])."""
        flat = experts.t().reshape(-1)
        order = torch.argsort(flat, stable=True)
        starts = torch.zeros(self.num_experts + 1, dtype=torch.int32)
        starts[1:] = torch.bincount(flat, minlength=self.num_experts).cumsum(0)
        return order % experts.shape[0], weights.t().reshape(-1)[order], starts

    def run_experts(self, x: torch.Tensor, tokens: torch.Tensor, starts: torch.Tensor,
                    ops=None) -> torch.Tensor:
        """Each pair's expert output [T k, hidden], the pairs in ``group``'s order."""
        grouped = self.grouped_gemms() if x.dtype is torch.float32 else None
        if grouped is not None:
            gate_up, down = grouped
            return down(gate_up(x[tokens], starts), starts)
        h = x.new_empty((tokens.shape[0], x.shape[1]))
        bounds = starts.tolist()
        for e in range(self.num_experts):
            if bounds[e + 1] > bounds[e]:
                rows = slice(bounds[e], bounds[e + 1])
                h[rows] = self.experts[e](x[tokens[rows]], ops)
        return h

    def combine(self, x: torch.Tensor, h: torch.Tensor, tokens: torch.Tensor,
                pair_weights: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        """The pairs' outputs scaled by their weights and added into their tokens' rows
        expert after expert, as transformers adds them. In float32 one ``index_add_``
        adds its pairs in order; in lower precisions it may accumulate otherwise, so
        there one call an expert, as transformers makes them."""
        out = torch.zeros_like(x)
        scaled = (h * pair_weights[:, None]).to(out.dtype)
        if out.dtype is torch.float32:
            out.index_add_(0, tokens, scaled)
            return out
        bounds = starts.tolist()
        for e in range(self.num_experts):
            if bounds[e + 1] > bounds[e]:
                rows = slice(bounds[e], bounds[e + 1])
                out.index_add_(0, tokens[rows], scaled[rows])
        return out

    def forward_native(self, x: torch.Tensor) -> torch.Tensor | None:
        """The block (before the all-reduce) as the router's GEMM and softmax, one native
        routing call (top-k, renormalising, grouping, gathering), the two grouped GEMMs
        and one native combine: float32 on conveyor's GEMM only. None where it does not
        apply (the torch ops then): another dtype or backend, the kernels off, or a tie
        at some row's k-th probability, whose order only torch's topk gives."""
        if x.dtype is not torch.float32 or x.dim() != 2 or x.stride(1) != 1:
            return None
        grouped = self.grouped_gemms()
        if grouped is None:
            return None
        from conveyor.kernels.cpu import moe_route

        lib = moe_route.load()
        if lib is None or self.top_k > lib.moe_route_max_k():
            return None
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        routed = moe_route.route(probs, x, self.top_k, self.renormalize, lib)
        if routed is None:
            return None
        gate_up, down = grouped
        h = down(gate_up(routed.rows, routed.starts), routed.starts)
        return moe_route.combine(h, routed, lib)

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:
        out = self.forward_native(x)
        if out is not None:
            return self.tp.all_reduce(out)
        weights, experts = self.route(x)
        tokens, pair_weights, starts = self.group(weights, experts)
        h = self.run_experts(x, tokens, starts, ops)
        return self.tp.all_reduce(self.combine(x, h, tokens, pair_weights, starts))


def moe_block(hf: dict, hidden: int, tp: TPShard, float32_weights: bool = False
              ) -> SparseMoE:
    """The block of a Mixtral or Qwen3-MoE config.json (Qwen3-MoE's dense layers,
    ``mlp_only_layers`` or a ``decoder_sparse_step`` above 1, are refused by name)."""
    if hf.get("mlp_only_layers") or int(hf.get("decoder_sparse_step", 1) or 1) != 1:
        raise ValueError("dense layers among the sparse ones (mlp_only_layers, "
                         "decoder_sparse_step > 1) are not supported")
    experts = hf.get("num_experts") or hf.get("num_local_experts")
    inter = hf.get("moe_intermediate_size") or hf["intermediate_size"]
    return SparseMoE(hidden, tp.intermediate(int(inter)), int(experts),
                     int(hf.get("num_experts_per_tok", 2)),
                     bool(hf.get("norm_topk_prob", True)), hf.get("hidden_act", "silu"), tp,
                     float32_weights)


def expert_linears(model: nn.Module) -> list[nn.Linear]:
    """Every expert projection of the model's mixture-of-experts blocks still an
    ``nn.Linear`` (not yet packed)."""
    return [m for block in model.modules() if isinstance(block, SparseMoE)
            for m in block.experts.modules() if isinstance(m, nn.Linear)]


def pack_experts(model: nn.Module, backend: str) -> int:
    """Pack every expert projection with ``backend`` (gate/up with silu fused where the
    backend can); returns how many were packed."""
    from conveyor.model.linear.packing import pack_linears

    return sum(pack_linears(block.experts, backend) for block in model.modules()
               if isinstance(block, SparseMoE))
