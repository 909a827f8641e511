"""Decode throughput with LoRA adapters in flight against the base model alone.

A batch of ``--batch`` requests (16-token prompts, no eos) through ``LLM.generate`` on
dummy weights of a preset or of ``--shape HIDDEN,INTERMEDIATE,LAYERS``; the requests take
1, 4 or 16 adapters round robin (``--max-loras`` 16: all in one step), at each rank.
Decode tokens per second: ``batch * (max_tokens - 1)`` over the time of a
``--max-tokens`` run less that of a one-token run (prefill and admission cancel out).
Each LoRA run is paired with a base run just before it, and the figure is the median
over ``--repeats`` pairs of their ratio: on a machine shared with other jobs the load
drifts, and only runs side by side compare. Adapters are written as PEFT checkpoints
(adapter_config.json + adapter_model.safetensors, random A and B, every projection).

    python -m benchmarks.lora.lora_throughput --shape 1024,2816,8 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from safetensors.torch import save_file

from conveyor import LLM, LoRARequest, SamplingParams
from conveyor.config.presets import PRESETS

TARGETS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
           "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(folder: str, cfg: dict, rank: int, seed: int) -> str:
    """A PEFT LoRA checkpoint of the preset's shape, every projection targeted."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim", hidden // cfg["num_attention_heads"])
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
              "o_proj": (hidden, q), "gate_proj": (inter, hidden),
              "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for part, names in TARGETS.items():
            for name in names:
                out, inp = shapes[name]
                key = f"base_model.model.model.layers.{layer}.{part}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) * 0.01
                tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.01
    path = os.path.join(folder, f"r{rank}-{seed}")
    os.makedirs(path)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": [n for names in TARGETS.values() for n in names]}, f)
    return path


def timed(llm: LLM, batch: int, max_tokens: int, loras: list[LoRARequest] | None) -> float:
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(16)] for i in range(batch)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    per = [loras[i % len(loras)] for i in range(batch)] if loras else None
    start = time.perf_counter()
    llm.generate(prompts, params, lora_request=per, use_tqdm=False)
    return time.perf_counter() - start


def decode_tok_s(llm: LLM, batch: int, max_tokens: int,
                 loras: list[LoRARequest] | None) -> float:
    decode = timed(llm, batch, max_tokens, loras) - timed(llm, batch, 1, loras)
    return batch * (max_tokens - 1) / decode


def paired(llm: LLM, batch: int, max_tokens: int, loras: list[LoRARequest],
           repeats: int) -> tuple[float, float, float]:
    """Medians of (base tok/s, LoRA tok/s, LoRA / base) over ``repeats`` pairs."""
    pairs = []
    for _ in range(repeats):
        base = decode_tok_s(llm, batch, max_tokens, None)
        lora = decode_tok_s(llm, batch, max_tokens, loras)
        pairs.append((base, lora, lora / base))
    return tuple(statistics.median(p[i] for p in pairs) for i in range(3))


def shaped_model(folder: str, shape: str) -> tuple[str, dict]:
    """A dummy-weight checkpoint folder of ``HIDDEN,INTERMEDIATE,LAYERS`` (Llama, head 64)."""
    from conveyor.config.presets import save_synthetic_tokenizer

    hidden, inter, layers = (int(x) for x in shape.split(","))
    cfg = dict(PRESETS["tiny"], hidden_size=hidden, intermediate_size=inter,
               num_hidden_layers=layers, num_attention_heads=hidden // 64,
               num_key_value_heads=max(1, hidden // 256), vocab_size=4096)
    path = os.path.join(folder, "model")
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_synthetic_tokenizer(path, cfg["vocab_size"])
    return path, cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(PRESETS))
    ap.add_argument("--shape", default=None, metavar="HIDDEN,INTERMEDIATE,LAYERS",
                    help="a Llama of this shape instead of --model")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--adapters", default="1,4,16")
    ap.add_argument("--ranks", default="8,16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3, help="pairs of runs per figure")
    args = ap.parse_args()
    counts = [int(x) for x in args.adapters.split(",")]
    ranks = [int(x) for x in args.ranks.split(",")]
    folder = tempfile.mkdtemp(prefix="conveyor-lora-bench-")
    model, cfg = (shaped_model(folder, args.shape) if args.shape
                  else (args.model, PRESETS[args.model]))
    llm = LLM(model, load_format="dummy", dtype="float32", enable_lora=True,
              max_loras=max(counts), max_cpu_loras=max(counts) * len(ranks),
              max_lora_rank=max(ranks), max_num_seqs=args.batch, num_threads=args.threads,
              enable_prefix_caching=False, max_model_len=256,
              num_kv_blocks=args.batch * 256 // 16 + 8)
    name = f"llama {args.shape} (hidden, intermediate, layers)" if args.shape else args.model
    print(f"# {name}, batch {args.batch}, {args.max_tokens} tokens each, "
          f"{torch.get_num_threads()} threads, median of {args.repeats} pairs")
    adapters = {r: [LoRARequest(f"r{r}-{k}", 1000 * r + k, write_adapter(folder, cfg, r, k))
                    for k in range(max(counts))] for r in ranks}
    timed(llm, args.batch, 4, None)  # warm
    print("| rank | adapters in flight | base decode tok/s | LoRA decode tok/s | LoRA vs base |")
    print("|---|---|---|---|---|")
    for r in ranks:
        for n in counts:
            base, lora, ratio = paired(llm, args.batch, args.max_tokens, adapters[r][:n],
                                       args.repeats)
            print(f"| {r} | {n} | {base:.1f} | {lora:.1f} | {100 * (ratio - 1):+.1f}% |",
                  flush=True)

if __name__ == "__main__":
    main()
