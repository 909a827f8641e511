"""How long the block pool takes to build and to cycle, at GPU-sized block counts.

A small model on an H200 has millions of KV blocks (Qwen3-0.6B's 28 layers x 8 KV heads
x 128 dims in bf16 are 112 KiB per 16-token block: ~1.1 million blocks in 120 GiB). The
pool is arrays (core/block_pool.py): this prints the build time, the memory it holds
(tracemalloc) and the time to allocate and release every block, per size.

    python -m benchmarks.experiments.block_pool_build --sizes 100000,1000000,4000000
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

from conveyor.core.block_pool import BlockPool
from conveyor.kernels.cpu.cpuinfo import cpu_model_name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="100000,1000000,4000000")
    args = p.parse_args()
    print(f"CPU: {cpu_model_name()}")
    for n in (int(s) for s in args.sizes.split(",")):
        tracemalloc.start()  # memory on one build, time on another (tracing slows it)
        traced = BlockPool(n)
        held, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        del traced
        t0 = time.perf_counter()
        pool = BlockPool(n)
        built = time.perf_counter() - t0
        t0 = time.perf_counter()
        ids = pool.allocate(n)
        pool.release(ids[::-1])
        cycle = time.perf_counter() - t0
        print(f"{n:>10,} blocks: built in {built * 1e3:8.1f} ms, {held / 2**20:7.1f} MiB, "
              f"allocate + release all {cycle * 1e3:8.1f} ms ({cycle / n * 1e9:.0f} ns a block)")


if __name__ == "__main__":
    main()
