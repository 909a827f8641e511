"""Automatic prefix caching, off against on, on workloads that repeat themselves.

    python -m benchmarks.scheduling.prefix_cache   # everything, one run per mode
    python -m benchmarks.scheduling.prefix_cache --repeats 3 --out prefix_cache.json
    python -m benchmarks.scheduling.prefix_cache --sections chat,lpm

Wall time on the shared 2-core machine: about 2 minutes with one run per mode (of which
20-40 s is the one-time compile of the decode-attention kernel), about 1 minute more per
extra repeat. Exits 1 if any check fails.

Sections (each a fresh engine per run, the same requests both ways, one process):

- chat: multi-turn chats in closed loop: turn k+1's prompt is turn k's prompt, the
  model's actual answer and a new user message, sent when turn k finishes.
- system: one shared system prompt, each request with its own question, Poisson
  arrivals.
- mooncake: the Mooncake synthetic trace with its hash_ids (whole prefix families
  sampled at random, lengths scaled so that a 512-token hash block becomes one
  16-token KV block); skipped when the trace is absent. Also replayed into a pool a
  quarter of its working set, to show what eviction costs.
- lpm: eight prefix families interleaved in arrival order into a pool smaller than
  the working set: fcfs against lpm (cache-aware order), both with caching on.

Printed per section: hit rate and the infinite-cache ideal (from the token blocks;
for mooncake also from the trace's hash ids), prefill tokens computed and saved,
TTFT mean/p50/p99, throughput, and PASS/FAIL lines:

- hit rate within 5 points of the ideal, where the pool holds the working set
  (pool blocks >= distinct full blocks computed + one partial block per sequence slot);
- TTFT in proportion to the prefill saved: a cached prompt token is one token less
  in the step that prefills its request, so it should take the marginal cost of a
  scheduled token (fitted on the caching-off run: step seconds = fixed + per_token *
  tokens) off that request's TTFT. Expected mean saving = per_token * prompt tokens
  saved per request; PASS when the measured mean TTFT saving is >= 0.75x that (about
  1x is exactly proportional; above 1x, the work no longer done also shortens queues).
  TTFT falls by a smaller *fraction* than prefill tokens do, because the fixed part of
  a step (scheduling, other requests' decodes) is not saved; the fit shows how much.

Model: the ``tiny`` dummy shape on one thread. A prefill of 1,000 tokens costs ~25 ms
against ~2 ms for a decode step, so prefill dominates TTFT and the saving is
measurable; ``smollm2-135m`` needs ~10 ms per prompt token on one core, which would
take an hour for workloads big enough to have a cache working set.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, replace

from benchmarks.common import traces_dir
from conveyor.bench.cli import parse_bench_args, vocab_size_of
from conveyor.bench.prefix import CacheIdeal, hash_id_ideal, token_ideal
from conveyor.bench.prefix_study import (
    CacheRun,
    proportionality,
    run_cache_mode,
)
from conveyor.bench.prefix_workloads import ChatSessions, prefix_family_requests
from conveyor.bench.report import fmt, table
from conveyor.bench.synthetic import parse_length_dist as dist
from conveyor.bench.workload import (
    describe,
    load_workload,
    workload_rows,
)
from conveyor.config import EngineArgs

TRACE = os.path.join(traces_dir(),
                     "mooncake_synthetic.jsonl")
SECTIONS = ("chat", "system", "mooncake", "lpm")
HIT_TOLERANCE_PP = 5.0
MIN_PROPORTION = 0.75
BLOCK_SIZE = 16
BIG_POOL = 8192  # blocks of 16 tokens: far above every working set below

# Workload parameters (printed with the results).
CHAT = dict(num_sessions=8, num_turns=6, first_len="uniform:512-1024",
            user_len="uniform:64-128", answer_len="uniform:24-40", session_rate=8.0)
SYSTEM = dict(num_requests=64, prefix_len=1024, suffix_len="uniform:32-128",
              output_len="uniform:16-48", rate=8.0)
MOONCAKE_ARGV = ["--sample", "families", "--num-requests", "200", "--request-rate", "16",
                 "--input-scale", "0.03125", "--output-scale", "0.25",
                 "--max-input-len", "2048"]
LPM = dict(num_requests=64, num_families=8, prefix_len=512, suffix_len="uniform:32-64",
           output_len="fixed:16", num_kv_blocks=192, max_num_seqs=4)


def engine_args(ns: argparse.Namespace, **kw) -> EngineArgs:
    base = dict(model=ns.model, load_format="dummy", dtype="float32", seed=ns.seed,
                num_threads=ns.num_threads, block_size=BLOCK_SIZE, num_kv_blocks=BIG_POOL,
                max_num_seqs=16, max_num_batched_tokens=2048)
    base.update(kw)
    return EngineArgs(**base)


def vocab_of(args: EngineArgs) -> int:
    return args.resolve_model().vocab_size


# ---- running --------------------------------------------------------------------------------
@dataclass
class Pair:
    """The caching-off and caching-on runs of one section (medians over repeats)."""

    name: str
    off: list[CacheRun]
    on: list[CacheRun]


def run_pair(name: str, make, args: EngineArgs, repeats: int, log) -> Pair:
    pair = Pair(name, [], [])
    for k in range(repeats):
        # Alternate which mode goes first, so a burst of load elsewhere hits both.
        for caching in ((False, True) if k % 2 == 0 else (True, False)):
            t = time.perf_counter()
            run = run_cache_mode(make, args, caching=caching)
            (pair.on if caching else pair.off).append(run)
            log(f"  {name} caching {'on ' if caching else 'off'} run {k + 1}: "
                f"{time.perf_counter() - t:.1f}s wall")
    return pair


def med(runs: list[CacheRun], get) -> float:
    values = [get(r) for r in runs]
    value = statistics.median(values)
    if all(isinstance(x, int) for x in values) and float(value).is_integer():
        return int(value)  # counts stay counts
    return value


# ---- reporting ------------------------------------------------------------------------------
def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def change(saved: float) -> str:
    """A saved fraction as a signed change: 0.25 saved is -25.0%."""
    return f"{-100 * saved:+.1f}%"


def compare_table(columns: dict[str, list[CacheRun]], ideal: dict[str, CacheIdeal]) -> str:
    def row(label, get, fmt_=fmt):
        return [label, *(fmt_(med(runs, get)) for runs in columns.values())]

    rows = [
        row("requests", lambda r: r.summary.num_completed),
        row("prompt tokens", lambda r: r.prompt_tokens),
        row("prefill tokens computed", lambda r: r.prefill_tokens),
        row("prefill tokens saved", lambda r: r.prompt_tokens - r.prefill_tokens),
        row("hit rate (engine)", lambda r: r.hit_rate, pct),
        *[[f"ideal hit rate ({name})", *([pct(i.hit_rate)] * len(columns))]
          for name, i in ideal.items()],
        row("TTFT mean (ms)", lambda r: r.ttft_ms("mean")),
        row("TTFT p50 (ms)", lambda r: r.ttft_ms("median")),
        row("TTFT p99 (ms)", lambda r: r.ttft_ms("p99")),
        row("requests/s", lambda r: r.summary.request_throughput),
        row("output tokens/s", lambda r: r.summary.output_throughput),
        row("duration (s)", lambda r: r.summary.duration_s),
        row("preemptions", lambda r: r.num_preemptions),
        row("evicted blocks", lambda r: r.num_evictions),
    ]
    return table(["", *columns], rows)


class Verdicts:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, ok: bool | None, text: str) -> None:
        tag = "PASS" if ok else ("FAIL" if ok is not None else "INFO")
        line = f"{tag} {text}"
        self.lines.append(line)
        print(line)


def pool_note(run: CacheRun, ideal: CacheIdeal, slots: int) -> tuple[bool, str]:
    need = ideal.working_set_blocks + slots
    holds = run.num_kv_blocks >= need
    word = "holds" if holds else "is SMALLER than"
    return holds, (f"pool {run.num_kv_blocks} blocks {word} the working set: "
                   f"{ideal.working_set_blocks} distinct full blocks + {slots} partial")


def check_hits(v: Verdicts, name: str, runs: list[CacheRun], ideal: CacheIdeal,
               holds: bool) -> dict:
    achieved = med(runs, lambda r: r.hit_rate)
    gap = 100 * (ideal.hit_rate - achieved)
    text = (f"{name}: hit rate {pct(achieved)} vs infinite-cache ideal {pct(ideal.hit_rate)} "
            f"({gap:+.1f} pp below")
    if holds:
        v.add(abs(gap) <= HIT_TOLERANCE_PP, text + f", limit {HIT_TOLERANCE_PP:g} pp)")
    else:
        v.add(None, text + "; pool smaller than the working set: the ideal is out of reach, "
                           "no criterion)")
    return {"hit_rate": achieved, "ideal": ideal.hit_rate, "gap_pp": gap}


def check_ttft(v: Verdicts, name: str, pair: Pair) -> dict:
    props = [proportionality(off, on) for off, on in zip(pair.off, pair.on)]
    ratios = [p.ratio() for p in props]
    ratio = None if None in ratios else statistics.median(ratios)
    m = statistics.median
    out = {"prefill_saved": m(p.prefill_saved for p in props),
           "saved_tokens_per_request": m(p.saved_tokens_per_request for p in props),
           "per_token_s": None if ratio is None else m(p.per_token_s for p in props),
           "fixed_s": None if ratio is None else m(p.fixed_s for p in props),
           "expected_ms": None if ratio is None else m(p.expected_ms for p in props),
           "ratio": ratio}
    for stat in ("mean", "median", "p99"):
        out[f"ttft_saved_{stat}"] = m(p.ttft_saved[stat] for p in props)
        out[f"ttft_saved_{stat}_ms"] = m(p.ttft_saved_ms[stat] for p in props)
    if ratio is not None:
        print(f"  off-run step cost fit: {1e3 * out['fixed_s']:.1f} ms + "
              f"{1e6 * out['per_token_s']:.1f} us per scheduled token; "
              f"{out['saved_tokens_per_request']:.0f} prompt tokens saved per request -> "
              f"expected mean TTFT saving {out['expected_ms']:.1f} ms")
    v.add(ratio is not None and ratio >= MIN_PROPORTION,
          f"{name}: prefill tokens {change(out['prefill_saved'])}, TTFT mean "
          f"{change(out['ttft_saved_mean'])} ({-out['ttft_saved_mean_ms']:+.1f} ms; p50 "
          f"{change(out['ttft_saved_median'])}, p99 {change(out['ttft_saved_p99'])}); "
          f"measured over expected mean saving {fmt(ratio)}x, needs >= {MIN_PROPORTION:g}x")
    return out


def section_pair(v: Verdicts, name: str, pair: Pair, ideals: dict[str, CacheIdeal],
                 slots: int) -> dict:
    token = ideals["token blocks"]
    print(compare_table({"caching off": pair.off, "caching on": pair.on}, ideals))
    holds, note = pool_note(pair.on[0], token, slots)
    print(note)
    off_seqs = pair.off[0].by_id()
    same = sum(off_seqs.get(rid) == seq for rid, seq in pair.on[0].by_id().items())
    v.add(None, f"{name}: generated tokens identical with caching off and on for {same} of "
                f"{len(pair.on[0].sequences)} requests (greedy)")
    res = {"hits": check_hits(v, name, pair.on, ideals[next(iter(ideals))], holds),
           "ttft": check_ttft(v, name, pair), "pool_holds_working_set": holds,
           "working_set_blocks": token.working_set_blocks,
           "ideals": {k: i.hit_rate for k, i in ideals.items()},
           "off": [summary_of(r) for r in pair.off], "on": [summary_of(r) for r in pair.on]}
    return res


def summary_of(run: CacheRun) -> dict:
    return {"hit_rate": run.hit_rate, "hits": run.hits, "queries": run.queries,
            "prefill_tokens": run.prefill_tokens, "prompt_tokens": run.prompt_tokens,
            "num_preemptions": run.num_preemptions, "num_evictions": run.num_evictions,
            "num_kv_blocks": run.num_kv_blocks, "policy": run.policy_stats,
            "summary": run.summary.to_dict()}


# ---- sections -------------------------------------------------------------------------------
def chat_section(ns, v: Verdicts, log) -> dict:
    args = engine_args(ns)
    vocab = vocab_of(args)
    spec = dict(CHAT)
    print(f"\n== chat: {spec}")

    def make():
        chat = ChatSessions(spec["num_sessions"], spec["num_turns"], dist(spec["first_len"]),
                            dist(spec["user_len"]), dist(spec["answer_len"]), vocab,
                            rate=spec["session_rate"], seed=ns.seed)
        return chat.first_turns(), chat.follow_up

    pair = run_pair("chat", make, args, ns.repeats, log)
    ideal = token_ideal(pair.on[0].sequences, BLOCK_SIZE)
    return section_pair(v, "chat", pair, {"token blocks": ideal}, args.max_num_seqs)


def system_section(ns, v: Verdicts, log) -> dict:
    args = engine_args(ns)
    vocab = vocab_of(args)
    spec = dict(SYSTEM)
    print(f"\n== system: {spec}")

    def make():
        return prefix_family_requests(spec["num_requests"], 1, spec["prefix_len"],
                                      dist(spec["suffix_len"]), dist(spec["output_len"]),
                                      vocab, rate=spec["rate"], seed=ns.seed), None

    pair = run_pair("system", make, args, ns.repeats, log)
    ideal = token_ideal(pair.on[0].sequences, BLOCK_SIZE)
    return section_pair(v, "system", pair, {"token blocks": ideal}, args.max_num_seqs)


def mooncake_section(ns, v: Verdicts, log) -> dict | None:
    if not os.path.isfile(ns.trace):
        print(f"\n== mooncake: skipped, {ns.trace} not found (set CONVEYOR_TRACES)")
        return None
    argv = ["--model", ns.model, "--load-format", "dummy", "--dtype", "float32",
            "--seed", str(ns.seed), "--block-size", str(BLOCK_SIZE),
            "--num-kv-blocks", str(BIG_POOL), "--max-num-seqs", "16",
            "--max-num-batched-tokens", "2048", "--workload", ns.trace, *MOONCAKE_ARGV]
    if ns.num_threads:
        argv += ["--num-threads", str(ns.num_threads)]
    print(f"\n== mooncake: each run is conveyor bench {shlex.join(argv)} "
          "(--no-enable-prefix-caching for the off run)")
    bench_args = parse_bench_args(argv)
    rows = workload_rows(bench_args)
    requests = load_workload(bench_args, vocab_size_of(bench_args))
    assert len(rows) == len(requests)
    print(f"workload: {describe(requests)}")
    args = EngineArgs.from_cli_args(bench_args)

    def make():
        return [replace(r) for r in requests], None

    pair = run_pair("mooncake", make, args, ns.repeats, log)
    ideals = {"trace hash ids": hash_id_ideal(rows),
              "token blocks": token_ideal(pair.on[0].sequences, BLOCK_SIZE)}
    out = section_pair(v, "mooncake", pair, ideals, args.max_num_seqs)

    # The same replay into a pool a quarter of the working set.
    biggest = max(-(-(r.prompt_len + r.output_len) // BLOCK_SIZE) for r in requests)
    small = max(ideals["token blocks"].working_set_blocks // 4, biggest + 1)
    print(f"\n-- mooncake, pool of {small} blocks (a quarter of the working set), "
          f"caching on, fcfs and lpm")
    runs = {}
    for policy in ("fcfs", "lpm"):
        small_args = replace(args, num_kv_blocks=small, scheduling_policy=policy)
        t = time.perf_counter()
        runs[policy] = [run_cache_mode(make, small_args, caching=True, label=policy)]
        log(f"  mooncake small pool {policy}: {time.perf_counter() - t:.1f}s wall")
    print(compare_table({"big pool": pair.on, "small fcfs": runs["fcfs"],
                         "small lpm": runs["lpm"]}, ideals))
    holds, note = pool_note(runs["fcfs"][0], ideals["token blocks"], args.max_num_seqs)
    print(note)
    print(f"lpm: {runs['lpm'][0].policy_stats}")
    for policy, r in runs.items():
        out[f"small_pool_{policy}"] = check_hits(v, f"mooncake small pool {policy}", r,
                                                 ideals["trace hash ids"], holds)
    return out


def lpm_section(ns, v: Verdicts, log) -> dict:
    spec = dict(LPM)
    args = engine_args(ns, num_kv_blocks=spec["num_kv_blocks"],
                       max_num_seqs=spec["max_num_seqs"])
    vocab = vocab_of(args)
    print(f"\n== lpm: {spec}, all at t=0, family of request i = i % "
          f"{spec['num_families']}")

    def make():
        return prefix_family_requests(spec["num_requests"], spec["num_families"],
                                      spec["prefix_len"], dist(spec["suffix_len"]),
                                      dist(spec["output_len"]), vocab, seed=ns.seed), None

    runs: dict[str, list[CacheRun]] = {"fcfs": [], "lpm": []}
    for k in range(ns.repeats):
        for policy in (("fcfs", "lpm") if k % 2 == 0 else ("lpm", "fcfs")):
            t = time.perf_counter()
            runs[policy].append(run_cache_mode(
                make, replace(args, scheduling_policy=policy), caching=True, label=policy))
            log(f"  lpm section {policy} run {k + 1}: {time.perf_counter() - t:.1f}s wall")
    ideal = token_ideal(runs["fcfs"][0].sequences, BLOCK_SIZE)
    print(compare_table({"fcfs": runs["fcfs"], "lpm": runs["lpm"]}, {"token blocks": ideal}))
    holds, note = pool_note(runs["fcfs"][0], ideal, args.max_num_seqs)
    print(note)
    hit = {p: med(r, lambda x: x.hit_rate) for p, r in runs.items()}
    print(f"lpm: {runs['lpm'][0].policy_stats}")
    v.add(hit["lpm"] > hit["fcfs"],
          f"lpm: hit rate {pct(hit['lpm'])} vs fcfs {pct(hit['fcfs'])} "
          f"(ideal {pct(ideal.hit_rate)}; pool {'holds' if holds else 'below'} the "
          "working set): cache-aware order must hit more")
    return {"hit_rate": hit, "ideal": ideal.hit_rate, "pool_holds_working_set": holds,
            "fcfs": [summary_of(r) for r in runs["fcfs"]],
            "lpm": [summary_of(r) for r in runs["lpm"]]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated: {', '.join(SECTIONS)}")
    p.add_argument("--repeats", type=int, default=1, help="runs per mode, alternating order")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=1,
                   help="torch threads (default 1: steadiest on a shared machine)")
    p.add_argument("--trace", default=TRACE, help="the Mooncake JSONL trace")
    p.add_argument("--out", default=None, help="save every figure as JSON")
    ns = p.parse_args()
    sections = ns.sections.split(",")
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or ns.repeats < 1:
        p.error(f"unknown section(s) {unknown}; valid: {', '.join(SECTIONS)}" if unknown
                else "--repeats must be >= 1")
    print(f"python -m benchmarks.scheduling.prefix_cache {shlex.join(sys.argv[1:])}")
    print(f"model {ns.model} (dummy weights, float32), {ns.num_threads} thread(s), seed "
          f"{ns.seed}, block size {BLOCK_SIZE}, {ns.repeats} run(s) per mode; figures are "
          "medians over runs; TTFT from arrival")
    t0 = time.perf_counter()
    v = Verdicts()
    results = {}
    runners = {"chat": chat_section, "system": system_section, "mooncake": mooncake_section,
               "lpm": lpm_section}
    for name in sections:
        results[name] = runners[name](ns, v, print)
    print(f"\n== verdicts ({time.perf_counter() - t0:.0f}s wall in all)")
    for line in v.lines:
        print(line)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"argv": sys.argv[1:], "params": {"chat": CHAT, "system": SYSTEM,
                                                        "mooncake": MOONCAKE_ARGV, "lpm": LPM},
                       "results": results, "verdicts": v.lines}, f, indent=1, default=str)
    return 1 if any(line.startswith("FAIL") for line in v.lines) else 0


if __name__ == "__main__":
    sys.exit(main())
