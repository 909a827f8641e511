"""``conveyor bench``: replay a workload through the engine or an OpenAI server; report.

    conveyor bench                                   # main job: static vs continuous
    conveyor bench --workload trace.csv --num-requests 200 --request-rate 4 --out run.json
    conveyor bench --backend openai --base-url http://127.0.0.1:8000 --model NAME ...
    conveyor bench --sweep-rate 1,2,4,inf --plot figs/
    conveyor bench compare A.json B.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import sys
from typing import TYPE_CHECKING, Any

from conveyor.bench.workload import BenchRequest, WorkloadError, add_workload_args, describe
from conveyor.config import EngineArgs

if TYPE_CHECKING:
    from conveyor.bench.batching import BatchingComparison

# `conveyor bench` with no arguments runs exactly this (printed with the results): a
# dummy tiny Llama and the conversation preset at one eighth of its prompt lengths and
# one quarter of its output lengths (prompt median 128, output median 32, max 250), all
# requests at t=0, static then continuous. One torch thread: a model this small gains
# nothing from a second, and on a shared machine a busy sibling thread stalls every op.
MAIN_JOB_ARGV = [
    "--model", "tiny", "--load-format", "dummy", "--dtype", "float32", "--num-threads", "1",
    "--workload", "conversation", "--num-requests", "128", "--request-rate", "inf",
    "--input-scale", "0.125", "--output-scale", "0.25",
    "--max-num-seqs", "16", "--max-num-batched-tokens", "1024",
    "--compare-batching", "--repeats", "1",
]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark: replay a workload and report latency and "
                                     "throughput",
                       description=__doc__.splitlines()[0] + " With no arguments: the main "
                       "job, static against continuous batching on a built-in workload.",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="\n".join(__doc__.splitlines()[2:]))
    add_bench_args(p)
    p.set_defaults(func=run)


def add_bench_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    EngineArgs.add_cli_args(p)
    add_workload_args(p)
    g = p.add_argument_group("bench")
    g.add_argument("--backend", default="engine", choices=("engine", "openai"),
                   help="engine: in-process LLMEngine; openai: an OpenAI-compatible server")
    g.add_argument("--step-cost", type=_parse_step_cost, default=None,
                   metavar="BASE,PER_TOKEN,PER_SEQ",
                   help="engine backend: replay in virtual time, each step costing BASE + "
                        "PER_TOKEN * tokens + PER_SEQ * requests seconds (deterministic; "
                        "see bench/model_clock.py)")
    g.add_argument("--base-url", default=None, help="openai backend: http://host:port")
    g.add_argument("--openai-model", default=None,
                   help="openai backend: the model name sent in requests (default: --model)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="openai backend: bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="openai backend: send ignore_eos so outputs have the forced length")
    g.add_argument("--openai-extra-body", type=json.loads, default=None,
                   help='openai backend: JSON merged into each request body; null deletes '
                        'a field, e.g. \'{"stream_options": null, "min_tokens": 0}\'')
    g.add_argument("--prompt-format", default="ids", choices=("ids", "text"),
                   help="openai backend: send prompts as token ids or as text decoded with "
                        "--tokenizer (or the --model folder's tokenizer)")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="openai backend: at most this many requests in flight")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="openai backend: seconds per request (default: none)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="prompt token ids are drawn below this (default: the model's)")
    g.add_argument("--compare-batching", action="store_true",
                   help="engine backend: run static and continuous batching alternately and "
                        "print them side by side with the ideal ratios for the sample")
    g.add_argument("--repeats", type=int, default=1,
                   help="--compare-batching: runs per mode")
    g.add_argument("--measure-step-costs", action=argparse.BooleanOptionalAction,
                   default=True, help="--compare-batching: measure the step time per batch "
                                      "size first, for the cost-weighted ideal")
    g.add_argument("--sweep-rate", type=_parse_rates, default=None,
                   help="comma-separated request rates to run one after another, e.g. "
                        "1,2,4,inf")
    g.add_argument("--out", default=None, help="save the summary as JSON here")
    g.add_argument("--records", default=None,
                   help="save per-request records as JSONL here (default with --out: "
                        "next to it, .records.jsonl)")
    g.add_argument("--plot", default=None, metavar="DIR",
                   help="write PNG figures here (latency CDFs; rate sweep; needs matplotlib: "
                        "pip install conveyor[plots])")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")
    sub = p.add_subparsers(dest="bench_command", metavar="{compare}")
    cmp_p = sub.add_parser("compare", help="print the ratios between two saved runs (B/A)")
    cmp_p.add_argument("a", help="result JSON of `conveyor bench --out`")
    cmp_p.add_argument("b", help="result JSON to compare with A (ratios are B/A)")
    return p


def run(args: argparse.Namespace) -> int:
    from conveyor.bench.report import compare_files

    if getattr(args, "bench_command", None) == "compare":
        try:
            print(compare_files(args.a, args.b))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    if _is_bare(args):
        print("conveyor bench (main job) = conveyor bench " + shlex.join(MAIN_JOB_ARGV))
        args = _standalone_parser().parse_args(MAIN_JOB_ARGV)
    try:
        return _run(args)
    except WorkloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from conveyor.bench import report

    _check_args(args)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    vocab = _vocab_size(args)
    requests = _load(args, args.request_rate, vocab)
    print(f"workload: {args.workload}: {describe(requests)}")
    print(f"target: {_target_line(args)}")
    config = _config_dict(args)
    extra: dict[str, Any] = {}
    if args.compare_batching:
        from conveyor.bench.batching import compare_batching

        cmp = compare_batching(requests, EngineArgs.from_cli_args(args), repeats=args.repeats,
                               measure_costs=args.measure_step_costs, progress=progress)
        print()
        print(cmp.format())
        results = [r for runs in cmp.runs.values() for r in runs]
        shown = [cmp.representative(mode) for mode in cmp.runs]
        extra["batching"] = cmp.headline()
        if cmp.costs is not None:
            extra["step_costs"] = {"batch_sizes": cmp.costs.batch_sizes,
                                   "decode_s": cmp.costs.decode_s,
                                   "prefill_s_per_token": cmp.costs.prefill_s_per_token}
    elif args.sweep_rate:
        results = []
        for rate in args.sweep_rate:
            reqs = _load(args, rate, vocab)
            result = _run_backend(args, reqs, f"rate={rate:g}", progress)
            results.append(result)
            print(f"  rate {rate:g}: {result.summary.output_throughput:.1f} output tokens/s, "
                  f"p99 TTFT {result.summary.latency['ttft'].p99:.0f} ms")
        shown = results
        print()
        print(report.format_comparison({r.label: r.summary for r in results}))
    else:
        result = _run_backend(args, requests, args.backend, progress)
        results = shown = [result]
        print()
        print(report.format_summary(result.summary, f"{args.backend} run"))
    failed = [r for res in results for r in res.records if r.error]
    if failed:
        print(f"\n{len(failed)} requests failed; first: request {failed[0].request_id}: "
              f"{failed[0].error}")
    _save(args, results, shown, config, extra)
    # Nothing completed is a failed benchmark (unreachable server, every prompt invalid).
    return 0 if any(r.summary.num_completed for r in results) else 1


def _run_backend(args: argparse.Namespace, requests: list[BenchRequest], label: str,
                 progress: bool):
    if args.backend == "engine":
        from conveyor.bench.engine_backend import run_engine

        return run_engine(requests, EngineArgs.from_cli_args(args), label=label,
                          progress=progress, cost_model=args.step_cost)
    from conveyor.bench.openai_backend import OpenAITarget, run_openai

    target = OpenAITarget(
        base_url=args.base_url, model=_request_model(args),
        ignore_eos=args.ignore_eos, extra_body=args.openai_extra_body or {},
        api_key=args.api_key, timeout_s=args.request_timeout,
        max_concurrency=args.max_concurrency,
        prompt_texts=_prompt_texts(args, requests) if args.prompt_format == "text" else None)
    return run_openai(requests, target, label=label, progress=progress)


def _save(args: argparse.Namespace, results: list, shown: list, config: dict,
          extra: dict) -> None:
    from conveyor.bench import report

    if args.out:
        report.save_json(args.out, shown if args.compare_batching else results, config,
                         {**extra, "all_runs": [{"label": r.label,
                                                 "summary": r.summary.to_dict()}
                                                for r in results]}
                         if args.compare_batching else extra)
        print(f"\nsummary saved to {args.out}")
    records_path = args.records
    if records_path is None and args.out:
        records_path = os.path.splitext(args.out)[0] + ".records.jsonl"
    if records_path:
        report.save_records(records_path, results)
        print(f"per-request records saved to {records_path}")
    if args.plot:
        from conveyor.bench.plots import plot_latency_cdfs, plot_rate_sweep

        paths = [plot_latency_cdfs(shown, os.path.join(args.plot, "latency_cdf.png"))]
        if args.sweep_rate:
            paths.append(plot_rate_sweep([(rate, r.summary) for rate, r in
                                          zip(args.sweep_rate, results)],
                                         os.path.join(args.plot, "rate_sweep.png")))
        print("figures: " + ", ".join(paths))


# ---- helpers ------------------------------------------------------------------------------
def _check_args(args: argparse.Namespace) -> None:
    if args.backend == "openai" and not args.base_url:
        raise WorkloadError("--backend openai needs --base-url")
    if args.compare_batching and args.backend != "engine":
        raise WorkloadError("--compare-batching runs the in-process engine: use "
                            "--backend engine")
    if args.step_cost is not None and (args.backend != "engine" or args.compare_batching):
        raise WorkloadError("--step-cost replays a plain engine-backend run (not --backend "
                            "openai or --compare-batching)")
    if args.compare_batching and args.sweep_rate:
        raise WorkloadError("--compare-batching and --sweep-rate do not combine")
    if args.request_rate is not None and args.time_scale != 1.0:
        raise WorkloadError("--request-rate and --time-scale both set arrival times: "
                            "pass one")
    if args.repeats < 1:
        raise WorkloadError(f"--repeats must be >= 1, got {args.repeats}")


def _load(args: argparse.Namespace, rate: float | None, vocab: int) -> list[BenchRequest]:
    from conveyor.bench.workload import load_workload

    args = copy.copy(args)
    args.request_rate = rate
    return load_workload(args, vocab)


def _vocab_size(args: argparse.Namespace) -> int:
    if args.vocab_size:
        return args.vocab_size
    try:
        return EngineArgs.from_cli_args(args).resolve_model().vocab_size
    except (ValueError, OSError) as e:
        raise WorkloadError(f"cannot read the vocabulary size of --model {args.model!r} "
                            f"({e}); pass --vocab-size") from None


def _prompt_texts(args: argparse.Namespace, requests: list[BenchRequest]) -> dict[str, str]:
    from conveyor.engine.detokenizer import load_tokenizer

    path = args.tokenizer or EngineArgs.from_cli_args(args).resolve_model().tokenizer
    if not path:
        raise WorkloadError("--prompt-format text needs --tokenizer (a tokenizer folder)")
    tok = load_tokenizer(path)
    return {r.request_id: tok.decode(r.prompt_token_ids) for r in requests}


def _target_line(args: argparse.Namespace) -> str:
    if args.backend == "openai":
        return f"openai {args.base_url} model {_request_model(args)}"
    return (f"engine model {args.model} (load format {args.load_format}, dtype {args.dtype}), "
            f"batching {'static+continuous' if args.compare_batching else args.batching}, "
            f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens "
            f"{args.max_num_batched_tokens}, policy {args.scheduling_policy}"
            + (f", virtual time (step cost {args.step_cost.describe()} s)"
               if args.step_cost is not None else ""))


def _request_model(args: argparse.Namespace) -> str:
    return args.openai_model or getattr(args, "served_model_name", None) or args.model


def _config_dict(args: argparse.Namespace) -> dict[str, Any]:
    out = {}
    for key, value in vars(args).items():
        if key in ("func", "api_key") or callable(value):
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            value = value.describe() if hasattr(value, "describe") else str(value)
        out[key] = value
    return out


def _parse_step_cost(text: str):
    from conveyor.costs.linear import LinearStepCost

    try:
        return LinearStepCost.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parse_rates(text: str) -> list[float]:
    rates = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        value = float(part)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"rates must be > 0 or inf, got {part}")
        rates.append(value)
    if not rates:
        raise argparse.ArgumentTypeError("no rate given")
    return rates


def _standalone_parser() -> argparse.ArgumentParser:
    return add_bench_args(argparse.ArgumentParser(prog="conveyor bench"))


def parse_bench_args(argv: list[str]) -> argparse.Namespace:
    """The options of ``conveyor bench ARGV`` (for scripts that drive the bench library)."""
    return _standalone_parser().parse_args(argv)


def vocab_size_of(args: argparse.Namespace) -> int:
    return _vocab_size(args)


def study(argv: list[str], *, repeats: int = 1, measure_costs: bool = True,
          progress: bool = False, log=print) -> tuple[list[BenchRequest], BatchingComparison]:
    """``conveyor bench --compare-batching ARGV`` as a library call, for the scripts."""
    from conveyor.bench.batching import compare_batching
    from conveyor.bench.workload import load_workload

    args = parse_bench_args(argv)
    requests = load_workload(args, vocab_size_of(args))
    log(f"workload: {describe(requests)}")
    cmp = compare_batching(requests, EngineArgs.from_cli_args(args), repeats=repeats,
                           measure_costs=measure_costs, progress=progress, log=log)
    return requests, cmp


def _is_bare(args: argparse.Namespace) -> bool:
    """True when no option was given: every value equals its default."""
    defaults = vars(_standalone_parser().parse_args([]))
    return all(getattr(args, key, None) == value for key, value in defaults.items())
