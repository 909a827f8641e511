"""Soft-capped decode attention (Gemma 2's capped layers, ``model/attention/softcap.py``):
this tree's against REV's ``softcap.py``, on the same cache, rows and slots, in alternating
rounds; prints each one's median and this tree's over REV's (below 1: this tree is faster).

Gemma-2 shape by default (4 query heads, 2 KV heads, head_dim 256), B decode rows with
contexts uniform in [C/4, C), slots scattered over the cache; ``--window W``: every row
attends its last W positions only (a sliding layer).

    python -m benchmarks.kernels.softcap_attention --against HEAD~1 --rows 32 --context 512
    python -m benchmarks.kernels.softcap_attention --against HEAD~1 --window 256
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time

import torch

from benchmarks.common import git_extract
from conveyor.model.attention import softcap as this_tree
from conveyor.model.attention.metadata import AttentionMetadata

PATH = "src/conveyor/model/attention/softcap.py"


def load_rev(rev: str):
    path = git_extract(rev, tempfile.mkdtemp(prefix="conveyor-softcap-"), PATH)
    spec = importlib.util.spec_from_file_location("softcap_rev", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", default="HEAD~1", help="git revision to compare with")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--window", type=int, default=0)
    p.add_argument("--heads", default="4,2,256", help="query heads, KV heads, head dim")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    hq, hkv, d = (int(v) for v in args.heads.split(","))
    b, c = args.rows, args.context
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(c // 4, c, (b,), generator=g, dtype=torch.int32)
    starts = ((lens - args.window).clamp(min=0) if args.window
              else torch.zeros(b, dtype=torch.int32))
    k_cache, v_cache = torch.randn(b * c, hkv, d, generator=g), torch.randn(b * c, hkv, d,
                                                                            generator=g)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=b,
                             decode_slots=torch.randperm(b * c, generator=g).view(b, c),
                             decode_lens=lens, decode_starts=starts)
    q = torch.randn(b, hq, d, generator=g)
    none = torch.zeros(0, hkv, d)
    arms = {"this tree": this_tree, args.against: load_rev(args.against)}

    def run(module):
        return module.capped_paged_attention(q, none, none, k_cache, v_cache, meta,
                                             d ** -0.5, 50.0)

    ref = run(arms[args.against])
    diff = (run(this_tree) - ref).abs().max().item()
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, module in arms.items():
            t = time.perf_counter()
            run(module)
            times[name].append(time.perf_counter() - t)
    mine, base = (statistics.median(times[n]) * 1e3 for n in arms)
    print(f"{b} rows, context up to {c}, window {args.window or 'none'}, heads {hq}/{hkv}x{d}, "
          f"{args.threads} threads; max |diff| {diff:.2e}")
    print(f"this tree {mine:.2f} ms, {args.against} {base:.2f} ms, "
          f"this tree / {args.against} {mine / base:.2f}")


if __name__ == "__main__":
    main()
