"""Soft-capped attention (Gemma 2) at the peers table's Gemma-2 shape (4 query heads, 2 KV
heads, head dim 256): the native kernels with the cap inside against ``softcap.py``'s
explicit products, for a decode batch over the paged cache and for a step's fresh
prompts (the peers workload's prompt lengths), in turns; the best of ``--rounds`` each.

    python -m benchmarks.kernels.capped_attention --threads 1
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from conveyor.kernels import cpu as kernels
from conveyor.kernels.cpu.cpuinfo import cpu_model_name
from conveyor.model.attention.metadata import AttentionMetadata, PrefillSegment
from conveyor.model.attention.native_decode import NativeDecode
from conveyor.model.attention.native_prefill import NativePrefill
from conveyor.model.attention.softcap import capped_decode, capped_paged_attention

HQ, HKV, D, CAP = 4, 2, 256, 50.0


def decode_case(batch: int, context: int, block: int = 16):
    torch.manual_seed(0)
    nblk = -(-context // block)
    k_cache = torch.randn(batch * nblk * block + block, HKV, D)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(batch * nblk)
    cols = torch.arange(context)
    slots = torch.stack([perm[b * nblk + cols // block] * block + cols % block
                         for b in range(batch)])
    lens = torch.full((batch,), context, dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long),
                             num_decodes=batch, decode_slots=slots, decode_lens=lens,
                             decode_starts=torch.zeros(batch, dtype=torch.int32))
    return torch.randn(batch, HQ, D), k_cache, v_cache, meta


def prefill_case(prompts: int, lo: int, hi: int):
    rng = random.Random(0)
    lens = [rng.randint(lo, hi) for _ in range(prompts)]
    t = sum(lens)
    qkv = torch.randn(t, (HQ + 2 * HKV) * D)
    q = qkv[:, :HQ * D].view(t, HQ, D)
    k = qkv[:, HQ * D:(HQ + HKV) * D].view(t, HKV, D)
    v = qkv[:, (HQ + HKV) * D:].view(t, HKV, D)
    segs, start = [], 0
    for n in lens:
        segs.append(PrefillSegment(start, n))
        start += n
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), prefills=segs)
    return q, k, v, meta


def best_ms(fn, rounds: int, clock) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return 1e3 * best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", default="32-256")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    lib = kernels.load()
    scale = D ** -0.5
    q, kc, vc, meta = decode_case(args.batch, args.context)
    native_dec, native_pre = NativeDecode(lib), NativePrefill(lib)
    lo, hi = (int(x) for x in args.prompt_len.split("-"))
    pq, pk, pv, pmeta = prefill_case(args.prompts, lo, hi)
    out = torch.empty_like(pq)
    segs = pmeta.fresh_segments()
    arms = {
        "decode, cap in C": lambda: native_dec(q, kc, vc, meta, scale, softcap=CAP),
        "decode, softcap.py": lambda: capped_decode(q, kc, vc, meta, scale, CAP),
        "prefill, cap in C": lambda: native_pre.varlen(pq, pk, pv, out, segs, scale,
                                                       softcap=CAP),
        "prefill, softcap.py": lambda: capped_paged_attention(pq, pk, pv, None, None, pmeta,
                                                              scale, CAP),
    }
    best = dict.fromkeys(arms, float("inf"))
    for r in range(args.rounds):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            best[name] = min(best[name], best_ms(arms[name], 3, clock))
    print(f"# capped attention, {HQ}/{HKV} heads x {D}, cap {CAP}; decode batch "
          f"{args.batch} x {args.context}; prefill {args.prompts} prompts of "
          f"{args.prompt_len}; {args.threads} threads "
          f"({'thread CPU' if args.threads == 1 else 'wall'} time), {cpu_model_name()}")
    for name, ms in best.items():
        print(f"{name:22s} {ms:8.2f} ms")
    print(f"decode softcap.py / C: {best['decode, softcap.py'] / best['decode, cap in C']:.2f}x;"
          f" prefill softcap.py / C: "
          f"{best['prefill, softcap.py'] / best['prefill, cap in C']:.2f}x")


if __name__ == "__main__":
    main()
