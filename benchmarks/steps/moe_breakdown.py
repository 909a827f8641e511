"""Where a mixture-of-experts decode step's time goes, at the peers' Qwen3-MoE shape
(``benchmarks/peers/shapes.py``: 16 experts of 512, top 4, hidden 512, 12 layers, a
49,152-entry tied LM head), dummy weights, float32.

With ``--threads 1`` the clock is the thread's CPU time, which another process's load
inflates far less than wall time (with more threads, wall time). Each part is timed by
wrapping its Python entry point, exclusive of the parts it calls
(a part's time is its own, less the wrapped parts inside it): the router's GEMM, the
routing (softmax, top-k, renormalising), the grouping (pairs sorted by expert, their
rows gathered: one native call, or torch's ops with ``--torch-routing``), the experts'
GEMMs (gate/up with SwiGLU, down), the combine, attention,
the other projections, the norms and RoPE, the LM head, and the rest of the step (the
layers' Python, the scheduler, input preparation, sampling). The experts' GEMMs are
also given as bytes/s (the weights of the experts the batch routed to, over their time)
beside a plain streaming read of a 256 MB float32 tensor on the same threads
(``torch.sum``), the bandwidth a weight-bound step could reach.

    python -m benchmarks.steps.moe_breakdown --batch 16 --threads 2
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import tempfile
import time

import torch

from benchmarks.peers.shapes import QWEN3_MOE
from conveyor import LLM, SamplingParams
from conveyor.config.presets import write_checkpoint_files

PARTS: collections.Counter = collections.Counter()
CLOCK = [time.perf_counter]  # the thread's CPU time at --threads 1 (load inflates it less)
_STACK: list[float] = []  # the wrapped parts' time inside the part now running


def _timed(fn, label):
    def timed(*args, **kwargs):
        t = CLOCK[0]()
        _STACK.append(0.0)
        try:
            return fn(*args, **kwargs)
        finally:
            dt = CLOCK[0]() - t
            inner = _STACK.pop()
            PARTS[label] += dt - inner
            if _STACK:
                _STACK[-1] += dt
    return timed


def _wrap(owner, name: str, label) -> None:
    setattr(owner, name, _timed(getattr(owner, name), label))


def instrument(llm: LLM) -> None:
    """Wrap each part's entry point (classes for the shared parts, the blocks' router
    modules one by one)."""
    from conveyor.kernels.cpu import moe_route
    from conveyor.kernels.cpu import ops as native_ops
    from conveyor.model.layers import ops
    from conveyor.model.layers.moe import SparseMoE
    from conveyor.model.models import decoder

    for cls in {type(m) for m in llm.engine.runner.model.modules()
                if isinstance(m, torch.nn.Linear) or hasattr(m, "out_features")}:
        if cls.__module__.startswith("conveyor") or cls is torch.nn.Linear:
            _wrap(cls, "forward", "projections: attention, LM head")
    for block in llm.engine.runner.model.modules():
        if isinstance(block, SparseMoE):
            block.gate.forward = _timed(block.gate.forward, "moe: router GEMM")
    _wrap(SparseMoE, "forward_native", "moe: block's Python + softmax")
    _wrap(moe_route, "route", "moe: routing + grouping + gather (native)")
    _wrap(moe_route, "combine", "moe: combine (native)")
    _wrap(SparseMoE, "route", "moe: routing (torch: softmax, top-k, renormalise)")
    _wrap(SparseMoE, "group", "moe: grouping (torch: sort pairs by expert)")
    _wrap(SparseMoE, "run_experts", "moe: gather rows + Python (torch)")
    _wrap(SparseMoE, "combine", "moe: combine (torch: scale, index_add)")
    gemm_call = native_ops.GroupedGemm.__call__

    def grouped(self, x, starts):
        label = "moe: experts gate/up GEMM" if self.gate_up else "moe: experts down GEMM"
        return _timed(gemm_call, label)(self, x, starts)

    native_ops.GroupedGemm.__call__ = grouped
    _wrap(decoder, "paged_attention", "attention (KV write + kernel)")
    for name in ("add_rms_norm", "rms_norm", "rope_"):
        _wrap(ops.NativeOps, name, "norms + RoPE")
        _wrap(ops.TorchOps, name, "norms + RoPE")
    _wrap(decoder.DecoderForCausalLM, "compute_logits", "LM head (rest of compute_logits)")
    _wrap(decoder.DecoderForCausalLM, "forward", "layers' Python (rest of forward)")


def build(path: str, batch: int, context: int) -> LLM:
    llm = LLM(path, dtype="float32", load_format="dummy", max_num_seqs=batch,
              max_num_batched_tokens=max(512, batch * context), enable_prefix_caching=False)
    rng = random.Random(0)
    for i in range(batch):
        llm.engine.add_request({"prompt_token_ids": [rng.randrange(10, 40000)
                                                     for _ in range(context)]},
                               SamplingParams(max_tokens=10_000, ignore_eos=True,
                                              temperature=0.0), request_id=str(i))
    for _ in range(3):
        llm.engine.step()
    return llm


def expert_bytes(llm: LLM) -> float:
    """Weight bytes of the experts a decode step's batch routes to (distinct experts a
    layer, summed), from one untimed step."""
    from conveyor.kernels.cpu import moe_route
    from conveyor.model.layers.moe import SparseMoE

    blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
    seen: list[int] = []
    route, native_route = SparseMoE.route, moe_route.route

    def counted(self, x):
        weights, experts = route(self, x)
        seen.append(int(experts.unique().numel()))
        return weights, experts

    def counted_native(*args):
        routed = native_route(*args)
        if routed is not None:
            seen.append(int((routed.starts[1:] > routed.starts[:-1]).sum()))
        return routed

    SparseMoE.route, moe_route.route = counted, counted_native
    try:
        llm.engine.step()
    finally:
        SparseMoE.route, moe_route.route = route, native_route
    b = blocks[0]
    return sum(seen) * 3 * b.hidden * b.intermediate * 4.0


def stream_gbs(threads: int) -> float:
    """A plain streaming read on ``threads`` threads: ``torch.sum`` over 256 MB, best of 5."""
    x = torch.ones(64 * 2**20)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--torch-routing", action="store_true",
                   help="route with torch's ops (the path before the native routing)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.threads == 1:
        CLOCK[0] = time.thread_time
    path = tempfile.mkdtemp(prefix="conveyor-moe-breakdown-")
    write_checkpoint_files(path, QWEN3_MOE)
    llm = build(path, args.batch, args.context)
    if args.torch_routing:
        from conveyor.model.layers.moe import SparseMoE

        for block in llm.engine.runner.model.modules():
            if isinstance(block, SparseMoE):
                block.forward_native = lambda x: None  # shadows the method
    moved = expert_bytes(llm)
    instrument(llm)
    best = None
    for _ in range(args.rounds):
        PARTS.clear()
        times = []
        for _ in range(args.steps):
            t = CLOCK[0]()
            llm.engine.step()
            times.append(CLOCK[0]() - t)
        med = statistics.mean(times)  # the mean, as the parts are
        if best is None or med < best[0]:
            best = (med, {k: v / args.steps for k, v in PARTS.items()})
    step, parts = best
    parts["scheduler, inputs, sampling (rest of step)"] = step - sum(parts.values())
    print(f"# Qwen3-MoE peers shape, batch {args.batch}, context {args.context}, "
          f"{args.threads} threads, float32, "
          f"{'thread CPU' if args.threads == 1 else 'wall'} time; ms per step (share), "
          "the best round's mean step")
    print("| part | ms | share |\n|---|---:|---:|")
    print(f"| **step** | **{1e3 * step:.2f}** | 100% |")
    for label, s in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"| {label} | {1e3 * s:.2f} | {100 * s / step:.0f}% |")
    gemm = parts.get("moe: experts gate/up GEMM", 0) + parts.get("moe: experts down GEMM", 0)
    if gemm:
        print(f"\nexperts' GEMMs: {moved / 1e6:.0f} MB of routed experts' weights a step at "
              f"{moved / gemm / 1e9:.1f} GB/s; a plain {args.threads}-thread streaming read: "
              f"{stream_gbs(args.threads):.1f} GB/s")


if __name__ == "__main__":
    main()
