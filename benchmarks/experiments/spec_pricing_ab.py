"""The draft-length rule's pricing, old against new, side by side in one process.

    python -m benchmarks.experiments.spec_pricing_ab --method suffix --batches 16,64 --rounds 10,4

Engines: speculation off, a second off engine (the measurement's resolution), and the
method with adaptive k twice: once priced against the whole step, prefill chunks included
(``DraftLengthController.PRICE_PREFILL``, the rule before 76e406a), once against the
step's decode part (the default). Same trained pair, prompts and rounds as
``benchmarks/spec/spec_decode.py --grid pair`` (whose ``run_grid`` runs them).
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.spec import spec_decode as sd
from benchmarks.spec import spec_pair


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", choices=("ngram", "suffix", "draft_model"), default="suffix")
    p.add_argument("--batches", default="16,64")
    p.add_argument("--rounds", default="10,4", help="one per batch size")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    per_batch = [int(r) for r in args.rounds.split(",")]
    if len(per_batch) != len(batches):
        p.error("--rounds: one per batch size")
    rounds = dict(zip(batches, per_batch))
    manifest = spec_pair.ensure_pair()
    target = manifest["target_path"]
    prompts = spec_pair.code_prompts(target, 2 + sum(b * r for b, r in rounds.items()), 128,
                                seed=0)
    cfg = {"method": args.method, "num_speculative_tokens": args.k, "adaptive": True}
    if args.method == "draft_model":
        cfg["model"] = manifest["draft_path"]
    old, new = f"{args.method}, old pricing", f"{args.method}, new pricing"
    configs = {"off": None, sd.CONTROL: None, old: cfg, new: cfg}

    def on_built(label: str, llm) -> None:
        if label == old:
            llm.engine.core.speculation.controller.PRICE_PREFILL = True

    print(f"CPU: {spec_pair.cpu_model_name()}; target {target}")
    sd.run_grid("pricing A/B", target, configs, batches, rounds, prompts, 128, args.threads,
                on_built=on_built)
    return 0


if __name__ == "__main__":
    sys.exit(main())
