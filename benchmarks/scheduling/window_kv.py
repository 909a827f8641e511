"""KV memory of a windowed model: blocks behind the window released as requests advance
against whole contexts kept, side by side in one run on the same pool.

``--family mistral`` (the default): a Mistral-shaped checkpoint windowed on every layer
(``core/kv_cache_manager.py`` frees its one table behind the window). ``--family gemma2``
(windowed and global layers alternating) or ``gemma3`` (5 windowed : 1 global): a hybrid
model, a block table per layer group (``core/kv_groups.py``: the windowed layers' pool
bounded by the window, the bytes that saves given to the global layers' pool), against
``--disable-hybrid-kv-cache-manager`` (whole contexts in every layer). All use the
``tiny`` preset's dimensions (``--num-layers`` layers, dummy weights, a ``--window``-token
window) and serve ``--num-requests`` requests of ``--prompt-len`` prompt tokens and
``--max-tokens`` outputs (ignore_eos) from a pool of ``--num-kv-blocks`` blocks of every
layer (the same bytes in both modes). Printed per mode: the peak blocks in use, the most
sequences running at once, preemptions, blocks released behind the window, wall time and
output tokens/s; then the ratios (freed / whole) the goal is about. The block counts,
the concurrency, preemptions and steps are the scheduler's exact decisions; the times
depend on the machine.

    python -m benchmarks.scheduling.window_kv
    python -m benchmarks.scheduling.window_kv --prompt-len 1024 --window 256 --num-kv-blocks 256
    python -m benchmarks.scheduling.window_kv --family gemma3 --num-kv-blocks 320
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


def hybrid_checkpoint(family: str, window: int, max_len: int, num_layers: int) -> str:
    """A Gemma-2 (alternating) or Gemma-3 (5 windowed : 1 global) shape, dummy weights."""
    base = {k: v for k, v in PRESETS["tiny"].items() if k not in ("architectures",
                                                                 "model_type")}
    hf = {**base, "num_hidden_layers": num_layers, "head_dim": 16,
          "query_pre_attn_scalar": 16, "sliding_window": window,
          "max_position_embeddings": max_len, "hidden_activation": "gelu_pytorch_tanh",
          "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
          "tie_word_embeddings": True}
    if family == "gemma2":
        hf.update(architectures=["Gemma2ForCausalLM"], model_type="gemma2",
                  attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    else:
        hf.update(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                  sliding_window_pattern=6, rope_theta=1_000_000.0,
                  rope_local_base_freq=10000.0)
    path = tempfile.mkdtemp(prefix=f"conveyor-window-kv-{family}-")
    write_checkpoint_files(path, hf)
    return path


def run(path: str, opts, free: bool) -> dict:
    hybrid = opts.family != "mistral"
    llm = LLM(path, load_format="dummy", dtype="float32", block_size=opts.block_size,
              num_kv_blocks=opts.num_kv_blocks, max_num_seqs=opts.max_num_seqs,
              max_num_batched_tokens=opts.max_num_batched_tokens,
              enable_prefix_caching=False,
              disable_hybrid_kv_cache_manager=hybrid and not free)
    kv = llm.engine.kv
    if hybrid:
        assert (kv.sliding_window is None
                and (type(kv).__name__ == "HybridKVCacheManager") == free), \
            "a hybrid model: layer groups when freeing, one table when not"
    else:
        assert kv.sliding_window == opts.window, "the engine should free behind the window"
    if not free and not hybrid:
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
    group = stats["kv_window_group"]  # a hybrid model's windowed layers' pool
    return {"peak_kv_blocks": stats["peak_kv_blocks"], "peak_running": stats["peak_running"],
            "pools": (f"full {stats['num_kv_blocks']} + windowed {group['num_blocks']} "
                      f"(peak {group['peak_blocks']})" if group else
                      f"{stats['num_kv_blocks']} blocks"),
            "preemptions": stats["num_preemptions"], "steps": stats["num_steps"],
            "freed_behind_window": stats["kv_window_freed_blocks"],
            "wall_s": wall, "output_tok_s": tokens / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", choices=("mistral", "gemma2", "gemma3"), default="mistral")
    p.add_argument("--num-layers", type=int, default=6, help="gemma2/gemma3 only")
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=160)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=1, help="runs of each arm, in turns")
    opts = p.parse_args()
    max_len = 4 * (opts.prompt_len + opts.max_tokens)
    path = (mistral_checkpoint(opts.window, max_len) if opts.family == "mistral" else
            hybrid_checkpoint(opts.family, opts.window, max_len, opts.num_layers))
    print(f"{opts.family}, window {opts.window}, {opts.num_requests} requests of "
          f"{opts.prompt_len} + "
          f"{opts.max_tokens} tokens, pool {opts.num_kv_blocks} blocks of {opts.block_size}, "
          f"max_num_seqs {opts.max_num_seqs}, budget {opts.max_num_batched_tokens}")
    # Arms in turns (whole, freed, then freed, whole, ...): the machine's drift falls on
    # both alike; each arm's figures are its median round's by output tok/s.
    labels = {False: "whole contexts", True: "freed behind window"}
    rounds: dict[str, list[dict]] = {label: [] for label in labels.values()}
    for i in range(opts.rounds):
        for free in ((False, True) if i % 2 == 0 else (True, False)):
            r = run(path, opts, free)
            rounds[labels[free]].append(r)
            print(f"{labels[free]:>20}: peak blocks {r['peak_kv_blocks']:4d}  peak running "
                  f"{r['peak_running']:3d}  preemptions {r['preemptions']:3d}  steps "
                  f"{r['steps']:4d}  freed "
                  f"{r['freed_behind_window']:5d}  {r['wall_s']:6.2f} s  "
                  f"{r['output_tok_s']:7.1f} output tok/s  pools {r['pools']}", flush=True)
    whole, freed = (sorted(rounds[label], key=lambda r: r["output_tok_s"])[opts.rounds // 2]
                    for label in labels.values())
    running = freed["peak_running"] / whole["peak_running"]
    line = (f"ratios (freed / whole): peak running {running:.2f}x, preemptions "
            f"{whole['preemptions']} -> {freed['preemptions']}, steps {whole['steps']} -> "
            f"{freed['steps']}, output tok/s "
            f"{freed['output_tok_s'] / whole['output_tok_s']:.2f}x")
    if opts.family == "mistral":
        line += (f"; blocks per running sequence at peak "
                 f"{whole['peak_kv_blocks'] / whole['peak_running']:.1f} -> "
                 f"{freed['peak_kv_blocks'] / freed['peak_running']:.1f}")
    print(line)


if __name__ == "__main__":
    main()
