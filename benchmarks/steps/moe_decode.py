"""A mixture-of-experts decode step against the dense model with the same active
parameters per token, dummy weights, side by side in one process.

The MoE is Mixtral-shaped (E experts of intermediate I, top-k routing); the dense model
is Llama with intermediate k * I, so a token's FLOPs and the weights one token reads
are the same. At batch 1 the two read the same bytes; as the batch grows, more experts
are active and the MoE reads up to E / k times the dense MLP's weights. The MoE runs
twice on the same engine: its experts' GEMMs grouped in two native calls a layer
(``moe``, the default where the experts are conveyor's GEMM) and one GEMM call per active
expert (``moe 1by1``, the path before). Rounds alternate the three so machine noise hits
each; the median step of each is printed, with the ratios.

A decode step streams its weights from memory, so each step's bandwidth is printed too:
the weight bytes it reads (every projection and the LM head; for the MoE, the router and
the experts its batch routed to, counted on untimed steps after the timed ones) plus its
KV reads, over the median step time. Where the MoE step achieves the dense step's
bandwidth, its extra time is its extra bytes: the roofline, not the kernel.

    python -m benchmarks.steps.moe_decode --batch 1,4,16 --threads 2
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch

from conveyor import LLM, SamplingParams
from conveyor.config.presets import write_checkpoint_files
from conveyor.model.layers.moe import SparseMoE

COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-5, "torch_dtype": "float32",
          "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "vocab_size": 32000,
          "max_position_embeddings": 4096, "rope_theta": 10000.0,
          "tie_word_embeddings": False}


def shapes(args) -> dict[str, dict]:
    base = {**COMMON, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
            "num_attention_heads": args.hidden // 64, "num_key_value_heads": args.hidden // 128}
    moe = {**base, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
           "intermediate_size": args.intermediate, "num_local_experts": args.experts,
           "num_experts_per_tok": args.top_k}
    dense = {**base, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "intermediate_size": args.top_k * args.intermediate}
    return {"moe": moe, "dense": dense}


def build(path: str, batch: int, context: int, linear_backend: str) -> LLM:
    llm = LLM(path, dtype="float32", load_format="dummy", max_num_seqs=batch,
              linear_backend=linear_backend,
              max_num_batched_tokens=max(512, batch * context), enable_prefix_caching=False)
    rng = random.Random(0)
    for i in range(batch):
        llm.engine.add_request({"prompt_token_ids": [rng.randrange(10, 30000)
                                                     for _ in range(context)]},
                               SamplingParams(max_tokens=10_000, ignore_eos=True,
                                              temperature=0.0), request_id=str(i))
    for _ in range(3):  # the prefill, then the first decode steps
        llm.engine.step()
    return llm


def moe_blocks(llm: LLM) -> list[SparseMoE]:
    model = llm.engine.runner.model
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def active_experts(llm: LLM, blocks: list[SparseMoE], steps: int = 3) -> float:
    """Distinct experts a decode step's batch routes to, summed over the layers (the
    mean of ``steps`` untimed steps): the router's top-k of each row, as the block
    takes it."""
    seen: list[int] = []

    def count(block: SparseMoE):
        def hook(_module, _args, logits):
            picked = torch.topk(logits.float(), block.top_k, dim=-1).indices
            seen.append(int(picked.unique().numel()))
        return hook

    handles = [b.gate.register_forward_hook(count(b)) for b in blocks]
    try:
        for _ in range(steps):
            llm.engine.step()
    finally:
        for h in handles:
            h.remove()
    return sum(seen) / steps


def step_bytes(args, experts_read: float | None, batch: int, context: int) -> float:
    """Bytes a float32 decode step reads: the layers' projections (the dense MLP, or the
    router and ``experts_read`` experts over all layers), the LM head, and the batch's
    KV at ``context`` tokens."""
    h, hd = args.hidden, 64
    q, kv = (h // 64) * hd, (h // 128) * hd
    attn = h * (q + 2 * kv) + q * h
    expert = 3 * h * args.intermediate
    if experts_read is None:
        layers = args.layers * (attn + args.top_k * expert)
    else:
        layers = args.layers * (attn + h * args.experts) + experts_read * expert
    kv_read = batch * context * args.layers * 2 * kv
    return 4.0 * (layers + h * 32000 + kv_read)


def one_by_one(blocks: list[SparseMoE], on: bool) -> None:
    """The blocks' experts one GEMM call each (on), or grouped where they can be (off)."""
    for block in blocks:
        if on:
            block.grouped_gemms = lambda: None  # an instance attribute shadows the method
        elif "grouped_gemms" in block.__dict__:
            del block.grouped_gemms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", default="1,8,32")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=1024, help="per expert")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="steps a round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--linear-backend", default="native",
                   help="both models' projections (native: conveyor's GEMM, what the "
                        "grouped experts need; auto: measured per shape at start-up)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    paths = {}
    for name, cfg in shapes(args).items():
        paths[name] = tempfile.mkdtemp(prefix=f"conveyor-moe-bench-{name}-")
        write_checkpoint_files(paths[name], cfg)
    print(f"MoE: {args.experts} experts x intermediate {args.intermediate}, top-{args.top_k}; "
          f"dense: intermediate {args.top_k * args.intermediate}; hidden {args.hidden}, "
          f"{args.layers} layers, float32, {args.threads} threads")
    print("batch  dense ms/step  moe ms/step  moe 1by1 ms/step  moe/dense  1by1/dense  "
          "experts/layer  bytes moe/dense  dense GB/s  moe GB/s")
    for batch in [int(b) for b in args.batch.split(",")]:
        llms = {name: build(path, batch, args.context, args.linear_backend)
                for name, path in paths.items()}
        blocks = moe_blocks(llms["moe"])
        grouped = all(b.grouped_gemms() is not None for b in blocks)
        runs = [("dense", "dense"), ("moe", "moe"), ("moe 1by1", "moe")]
        times: dict[str, list[float]] = {label: [] for label, _ in runs}
        for _ in range(args.rounds):
            for label, name in runs:
                one_by_one(blocks, label == "moe 1by1")
                for _ in range(args.steps):
                    t = time.perf_counter()
                    llms[name].engine.step()
                    times[label].append(time.perf_counter() - t)
        one_by_one(blocks, False)
        d, m, m1 = (statistics.median(times[label]) * 1e3 for label, _ in runs)
        # (the context at the timed steps' middle)
        context = args.context + 3 + args.rounds * args.steps // 2
        read = active_experts(llms["moe"], blocks)
        bd = step_bytes(args, None, batch, context)
        bm = step_bytes(args, read, batch, context)
        print(f"{batch:5d}  {d:13.2f}  {m:11.2f}  {m1:16.2f}  {m / d:9.2f}  {m1 / d:10.2f}  "
              f"{read / args.layers:13.2f}  {bm / bd:15.2f}  {bd / d / 1e6:10.1f}  "
              f"{bm / m / 1e6:8.1f}"
              + ("" if grouped else "  (experts not grouped: not conveyor's GEMM here)"))
        del llms


if __name__ == "__main__":
    main()
