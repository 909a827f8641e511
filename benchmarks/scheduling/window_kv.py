"""KV memory of a model windowed on every layer: blocks behind the window released as
requests advance (``core/kv_cache_manager.py``) against whole contexts kept, side by
side in one run on the same pool.

A Mistral-shaped checkpoint (the ``tiny`` preset's dimensions, dummy weights, a
``--window``-token sliding window on every layer) serves ``--num-requests`` requests of
``--prompt-len`` prompt tokens and ``--max-tokens`` outputs (ignore_eos) from a pool of
``--num-kv-blocks`` blocks. Printed per mode: the peak blocks in use, the most sequences
running at once, preemptions, blocks released behind the window, wall time and output
tokens/s; then the ratios (freed / whole) the goal is about. The block counts and the
concurrency are the scheduler's exact decisions; the times depend on the machine.

    python -m benchmarks.scheduling.window_kv
    python -m benchmarks.scheduling.window_kv --prompt-len 1024 --window 256 --num-kv-blocks 256
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from conveyor import LLM, SamplingParams
from conveyor.config.presets import PRESETS, write_checkpoint_files


def mistral_checkpoint(window: int, max_len: int) -> str:
    hf = {**PRESETS["tiny"], "architectures": ["MistralForCausalLM"], "model_type": "mistral",
          "sliding_window": window, "max_position_embeddings": max_len,
          "hidden_act": "silu", "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2}
    path = tempfile.mkdtemp(prefix="conveyor-window-kv-")
    write_checkpoint_files(path, hf)
    return path


def run(path: str, opts, free: bool) -> dict:
    llm = LLM(path, load_format="dummy", dtype="float32", block_size=opts.block_size,
              num_kv_blocks=opts.num_kv_blocks, max_num_seqs=opts.max_num_seqs,
              max_num_batched_tokens=opts.max_num_batched_tokens,
              enable_prefix_caching=False)
    kv = llm.engine.kv
    assert kv.sliding_window == opts.window, "the engine should free behind the window"
    if not free:
        # The baseline: the same engine keeping whole contexts (what
        # CacheConfig.free_outside_window=False gives), set before any request.
        kv.sliding_window = None
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 2048) for _ in range(opts.prompt_len)]
               for _ in range(opts.num_requests)]
    params = SamplingParams(max_tokens=opts.max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    wall = time.perf_counter() - t0
    stats = llm.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"peak_kv_blocks": stats["peak_kv_blocks"], "peak_running": stats["peak_running"],
            "preemptions": stats["num_preemptions"],
            "freed_behind_window": stats["kv_window_freed_blocks"],
            "wall_s": wall, "output_tok_s": tokens / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=160)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    opts = p.parse_args()
    path = mistral_checkpoint(opts.window, 4 * (opts.prompt_len + opts.max_tokens))
    print(f"window {opts.window}, {opts.num_requests} requests of {opts.prompt_len} + "
          f"{opts.max_tokens} tokens, pool {opts.num_kv_blocks} blocks of {opts.block_size}, "
          f"max_num_seqs {opts.max_num_seqs}, budget {opts.max_num_batched_tokens}")
    results = {}
    for label, free in (("whole contexts", False), ("freed behind window", True)):
        r = results[label] = run(path, opts, free)
        print(f"{label:>20}: peak blocks {r['peak_kv_blocks']:4d}  peak running "
              f"{r['peak_running']:3d}  preemptions {r['preemptions']:3d}  freed "
              f"{r['freed_behind_window']:5d}  {r['wall_s']:6.2f} s  "
              f"{r['output_tok_s']:7.1f} output tok/s")
    whole, freed = results["whole contexts"], results["freed behind window"]
    running = freed["peak_running"] / whole["peak_running"]
    print(f"ratios (freed / whole): peak running {running:.2f}x, "
          f"output tok/s {freed['output_tok_s'] / whole['output_tok_s']:.2f}x; blocks per "
          f"running sequence at peak {whole['peak_kv_blocks'] / whole['peak_running']:.1f} -> "
          f"{freed['peak_kv_blocks'] / freed['peak_running']:.1f}")


if __name__ == "__main__":
    main()
