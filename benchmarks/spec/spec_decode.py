"""Speculative decoding, measured: tokens/s and accepted length, off vs each method, fixed
k vs adaptive k, side by side in one run.

Two grids:

* ``pair``: a real target/draft pair trained here on the Python standard library
  (benchmarks/spec/spec_pair.py, cached), on code-completion prompts cut from held-out files;
  batch 1, 4, 16, 64; off, ngram, suffix and draft_model, each with k = 4 fixed and
  with the adaptive k.
* ``synthetic``: drafts accepted at a fixed rate (0, 0.3, 0.6, 0.9) whatever the target
  says, at batch 1, 8, 32, on the same target: where speculation pays and where it would
  lose, and whether the adaptive k keeps it from losing.

Every configuration runs the same prompts in the same round between two "off" runs on
them (its speedup is the median over rounds of its ratio to their mean: this VM's speed
drifts by 5-10% between minutes, the three runs are seconds apart), rounds rotate
the order, and each (batch, round) gets prompts of its own (the suffix proposer learns
from earlier requests: it must not meet the same prompt twice). Greedy, fixed output length, prefix
caching off (prefill is part of end-to-end time).

Each grid also runs **a second engine with speculation off** ("off, 2nd engine"), paired
with the first like every configuration: two identical engines (their own weights,
caches and pools in memory) measured this way come out a few percent apart on this VM,
and that row prints how far, so that a configuration's ratio is read against the
measurement's own resolution. Each ratio also gets a bootstrap 95% interval of its median
over the rounds (the engines' own few-percent difference is not in it: no number of
rounds averages out where each engine's memory landed).

    python -m benchmarks.spec.spec_decode                                   # both grids
    python -m benchmarks.spec.spec_decode --grid pair --batches 1,4 --rounds 2
    python -m benchmarks.spec.spec_decode --grid pair --rounds 20,20,12,6   # per batch size
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable

from benchmarks.spec import spec_pair
from conveyor import LLM, SamplingParams

CONTROL = "off, 2nd engine"  # speculation off on an engine of its own: the noise floor


def pair_configs(draft_path: str, k: int) -> dict[str, dict | None]:
    out: dict[str, dict | None] = {"off": None, CONTROL: None}
    methods = {"ngram": {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5},
               "suffix": {"method": "suffix"},
               "draft": {"method": "draft_model", "model": draft_path}}
    for name, cfg in methods.items():
        for adaptive in (False, True):
            out[f"{name}{'+adaptive' if adaptive else ''}"] = {
                **cfg, "num_speculative_tokens": k, "adaptive": adaptive}
    return out


def synthetic_configs(k: int, rates: list[float]) -> dict[str, dict | None]:
    out: dict[str, dict | None] = {"off": None, CONTROL: None}
    for rate in rates:
        for adaptive in (False, True):
            out[f"rate {rate}{' adaptive' if adaptive else ''}"] = {
                "method": "synthetic", "acceptance_rate": rate, "num_speculative_tokens": k,
                "adaptive": adaptive}
    return out


def median_ci(values: list[float], level: float = 0.95,
              resamples: int = 2000) -> tuple[float, float]:
    """A bootstrap interval for the median of ``values`` (rounds resampled with
    replacement; a fixed seed, so a rerun on the same numbers prints the same interval).
    Two rounds or fewer: the range."""
    if len(values) <= 2:
        return min(values), max(values)
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(values, k=len(values)))
                  for _ in range(resamples))
    tail = (1.0 - level) / 2
    return meds[int(tail * resamples)], meds[min(int((1 - tail) * resamples), resamples - 1)]


def spec_counts(llm: LLM) -> tuple[int, int, int]:
    s = llm.stats().get("spec_decode") or {}
    return (s.get("num_draft_tokens", 0), s.get("num_accepted_tokens", 0),
            s.get("num_verify_steps", 0))


def run_grid(name: str, target: str, configs: dict[str, dict | None], batches: list[int],
             rounds: dict[int, int], prompts: list[list[int]], max_tokens: int,
             threads: int, load_format: str = "auto",
             on_built: Callable[[str, LLM], None] | None = None) -> dict:
    """``on_built(label, llm)``: called on each engine once built (an A/B sets a knob)."""
    max_batch = max(batches)
    # Every request fits in this: the KV pool (sized from it) stays small, so that a
    # dozen engines side by side fit in memory.
    max_len = len(prompts[0]) + max_tokens + 16
    llms = {}
    for label, cfg in configs.items():
        llms[label] = LLM(target, dtype="float32", max_num_seqs=max_batch,
                          max_num_batched_tokens=1024, enable_prefix_caching=False,
                          num_threads=threads, speculative_config=cfg,
                          load_format=load_format, max_model_len=max_len)
        if on_built is not None:
            on_built(label, llms[label])
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for llm in llms.values():  # first-call costs out of the way
        llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0))
    results: dict[str, dict] = {}
    cursor = 2
    for batch in batches:
        times = {label: [] for label in configs}
        ratios = {label: [] for label in configs}
        spec = {label: [0, 0, 0] for label in configs}
        for r in range(rounds[batch]):
            batch_prompts = prompts[cursor:cursor + batch]
            cursor += batch
            if len(batch_prompts) < batch:
                raise ValueError("not enough prompts: raise --num-prompts")
            order = [label for label in configs if label != "off"]
            order = order[r % len(order):] + order[:r % len(order)] if order else []
            # Each configuration between two "off" runs on the same prompts (the one
            # before it and the one before the next configuration, or a last one): its
            # ratio is against their mean, which a linear drift of the machine's speed
            # between minutes cannot move.
            runs = ["off"]
            for label in order:
                runs += [label, "off"]
            seq = []
            for label in runs:
                llm = llms[label]
                # Each engine holds its own weights: the last one run left the caches
                # with its own. A short call first: no run pays for a cold start.
                llm.generate(prompts[:1], warm)  # seen before: no proposer learns
                before = spec_counts(llm)
                t0 = time.perf_counter()
                outs = llm.generate(batch_prompts, params)
                dt = time.perf_counter() - t0
                assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
                times[label].append(dt)
                seq.append((label, dt))
                if label != "off":
                    after = spec_counts(llm)
                    for i in range(3):
                        spec[label][i] += after[i] - before[i]
            for i in range(1, len(seq) - 1, 2):
                label, dt = seq[i]
                ratios[label].append((seq[i - 1][1] + seq[i + 1][1]) / 2 / dt)
        off = statistics.median(times["off"])
        rows = {}
        for label in configs:
            t = statistics.median(times[label])
            drafts, accepted, verifies = spec[label]
            rows[label] = {
                "tokens_per_s": batch * max_tokens / t,
                # the median of the ratios (mean of the flanking off runs / this)
                "speedup": statistics.median(ratios[label]) if ratios[label] else off / t,
                "speedup_ci95": median_ci(ratios[label]) if ratios[label] else None,
                "mean_acceptance_length": (1 + accepted / verifies) if verifies else None,
                "acceptance_rate": accepted / drafts if drafts else None,
                "drafts_per_token": drafts / (batch * max_tokens * rounds[batch]),
            }
        results[str(batch)] = rows
        print(f"\n[{name}] batch {batch}: median of {rounds[batch]} rounds, "
              f"{max_tokens} tokens each")
        print(f"  {'config':<18} {'tokens/s':>9} {'vs off':>7} {'95% CI':>13} {'acc.len':>8} "
              f"{'acc.rate':>8} {'drafts/tok':>10}")
        for label, row in rows.items():
            acc, rate = row["mean_acceptance_length"], row["acceptance_rate"]
            acc_s = "-" if acc is None else f"{acc:.2f}"
            rate_s = "-" if rate is None else f"{rate:.2f}"
            ci = row["speedup_ci95"]
            ci_s = "-" if ci is None else f"[{ci[0]:.2f}, {ci[1]:.2f}]"
            print(f"  {label:<18} {row['tokens_per_s']:>9.1f} {row['speedup']:>6.2f}x "
                  f"{ci_s:>13} {acc_s:>8} {rate_s:>8} {row['drafts_per_token']:>10.2f}")
        sys.stdout.flush()
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grid", choices=("pair", "synthetic", "both"), default="both")
    p.add_argument("--batches", default=None, help="comma-separated (default per grid)")
    p.add_argument("--rounds", default="2",
                   help="rounds per batch size: one number for all, or one per batch "
                        "(comma-separated, as --batches)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rates", default="0,0.3,0.6,0.9")
    p.add_argument("--synthetic-model", default=None,
                   help="the synthetic sweep's model: a built-in shape with dummy weights "
                        "(e.g. smollm2-135m) instead of the trained target")
    p.add_argument("--configs", default=None,
                   help="comma-separated labels to run (e.g. 'off,draft+adaptive'; 'off' "
                        f"and '{CONTROL}' always run): a subset of the grid's "
                        "configurations")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()

    cpu_model = spec_pair.cpu_model_name
    manifest = spec_pair.ensure_pair()
    target, draft = manifest["target_path"], manifest["draft_path"]
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores); target {target} "
          f"(held-out loss {manifest['target'].get('heldout_loss')}), draft {draft} "
          f"(held-out loss {manifest['draft'].get('heldout_loss')})")
    out = {"cpu": cpu_model(), "manifest": {k: manifest[k] for k in ("target", "draft")}}
    grids = ("pair", "synthetic") if args.grid == "both" else (args.grid,)
    for grid in grids:
        default = "1,4,16,64" if grid == "pair" else "1,8,32"
        batches = [int(b) for b in (args.batches or default).split(",")]
        per_batch = [int(r) for r in args.rounds.split(",")]
        if len(per_batch) == 1:
            per_batch *= len(batches)
        if len(per_batch) != len(batches) or min(per_batch) < 1:
            p.error(f"--rounds: one number, or one per batch size ({len(batches)})")
        rounds = dict(zip(batches, per_batch))
        need = 2 + sum(b * r for b, r in rounds.items())
        prompts = spec_pair.code_prompts(target, need, args.prompt_tokens,
                                    seed=0 if grid == "pair" else 1)
        configs = (pair_configs(draft, args.k) if grid == "pair" else
                   synthetic_configs(args.k, [float(r) for r in args.rates.split(",")]))
        if args.configs:
            keep = {"off", CONTROL, *args.configs.split(",")}
            unknown = keep - set(configs)
            if unknown:
                p.error(f"--configs: no {', '.join(sorted(unknown))} in the {grid} grid "
                        f"(known: {', '.join(configs)})")
            configs = {label: cfg for label, cfg in configs.items() if label in keep}
        model, load_format = target, "auto"
        if grid == "synthetic" and args.synthetic_model:
            model, load_format = args.synthetic_model, "dummy"
        print(f"\n== {grid}: {model}")
        out[grid] = run_grid(grid, model, configs, batches, rounds, prompts,
                             args.max_tokens, args.threads, load_format)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
