"""Applying a step's grammar bitmask to the logits, ms per step: the unpack-then-fill the
runner used before (every row unpacked to a [batch, vocab] bool, one masked fill), the
numpy fallback over the constrained rows only, llguidance's own numpy helper, and the
native kernel on the packed int32 words (kernels/cpu/token_bitmask.c). Half the rows of
a batch constrained, each allowing ``--allowed`` random tokens (a JSON grammar's typical
mask: most words all zero), one thread, the methods taking turns.

    PYTHONPATH=src python benchmarks/structured/apply_mask.py
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from conveyor.kernels.cpu.token_bitmask import apply_token_bitmask, load


def masks(rows: int, vocab: int, allowed: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    words = np.zeros((rows, (vocab + 31) // 32), dtype=np.uint32)
    for r in range(rows):
        for t in rng.choice(vocab, allowed, replace=False):
            words[r, t // 32] |= np.uint32(1 << (t % 32))
    return torch.from_numpy(words.view(np.int32))


def unpack_all(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    n, vocab = logits.shape
    banned = np.unpackbits((~mask.numpy()).view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    full = np.zeros((n, vocab), dtype=np.uint8)
    full[rows.numpy()] = banned
    logits.masked_fill_(torch.from_numpy(full).view(torch.bool), float("-inf"))


def llguidance_numpy(logits: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor) -> None:
    import llguidance.numpy as lln

    sub = logits.numpy()[rows.numpy()]
    lln.apply_token_bitmask_inplace(sub, mask.numpy())
    logits.numpy()[rows.numpy()] = sub


def median_ms(methods: dict, logits, mask, rows, repeat: int) -> dict[str, float]:
    """Median ms of each method, the methods taking turns (a load spike on a shared
    machine hits them alike)."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeat):
        for name, fn in methods.items():
            x = logits.clone()
            t0 = time.perf_counter()
            fn(x, mask, rows)
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * sorted(t)[repeat // 2] for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vocab", type=str, default="32000,151936")
    ap.add_argument("--allowed", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    methods = {
        "unpack_all (before)": unpack_all,
        "numpy_rows (fallback)": lambda x, m, r: apply_token_bitmask(x, m, r, native=False),
        "llguidance.numpy": llguidance_numpy,
    }
    if load() is not None:
        methods["native (now)"] = apply_token_bitmask
    for vocab in (int(v) for v in args.vocab.split(",")):
        rows = torch.arange(1, args.batch, 2, dtype=torch.int64)
        mask = masks(len(rows), vocab, args.allowed)
        logits = torch.randn(args.batch, vocab)
        want = logits.clone()
        unpack_all(want, mask, rows)
        for name, fn in methods.items():
            got = logits.clone()
            fn(got, mask, rows)
            assert torch.equal(got, want), name
        ms = median_ms(methods, logits, mask, rows, args.repeat)
        base = ms["unpack_all (before)"]
        for name, t in ms.items():
            print(f"vocab {vocab:6d}, batch {args.batch}, {len(rows)} constrained: "
                  f"{name:22s} {t:8.3f} ms  ({base / t:5.1f}x the unpack)")

if __name__ == "__main__":
    main()
