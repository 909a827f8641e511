"""``conveyor profile``: measure this machine's step times, fit the simulator's cost model."""

from __future__ import annotations

import argparse

from conveyor.config import EngineArgs


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure step latencies and fit a simulator cost model",
                       description="Run the real engine over a grid of batch shapes (prefill "
                                   "tokens, decode batch size, context length), time every "
                                   "step and fit the cost model `conveyor sim --cost "
                                   "profile.json` uses. With no --model, the tiny "
                                   "dummy-weight model (seconds); a larger model on a CPU "
                                   "takes minutes: shrink the grid with --batch-sizes, "
                                   "--context-lens and --prefill-tokens.")
    EngineArgs.add_cli_args(p)
    p.add_argument("--out", required=True, help="where to write profile.json")
    p.add_argument("--batch-sizes", type=_ints, default=(1, 2, 4, 8, 16, 32),
                   help="decode batch sizes (default 1,2,4,8,16,32)")
    p.add_argument("--context-lens", type=_ints, default=(32, 128, 512),
                   help="context lengths of the decode batches (default 32,128,512)")
    p.add_argument("--prefill-tokens", type=_ints, default=(16, 64, 128, 256, 512),
                   help="prefill sizes (default 16,64,128,256,512; at most "
                        "--max-num-batched-tokens)")
    p.add_argument("--decode-steps", type=int, default=6,
                   help="decode steps timed per (batch size, context length)")
    p.add_argument("--repeats", type=int, default=3,
                   help="passes over the grid; each shape's time is its median (default 3)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from conveyor.sim.profiler import ProfileGrid, build_profile

    engine_args = EngineArgs.from_cli_args(args)
    grid = ProfileGrid(batch_sizes=args.batch_sizes, context_lens=args.context_lens,
                       prefill_tokens=args.prefill_tokens, decode_steps=args.decode_steps,
                       repeats=args.repeats)
    profile, samples = build_profile(engine_args, grid)
    profile.save(args.out, samples)
    fit = profile.fit
    coef = ", ".join(f"{k}={v:.3g}" for k, v in fit.coefficients.items())
    print(f"profiled {engine_args.model} on {profile.device}: {fit.num_samples} steps "
          f"({fit.num_dropped} outliers dropped); knees at {fit.small_knee:g} and "
          f"{fit.knee:g} tokens; {coef}")
    print(f"fit error: median {fit.median_rel_error:.1%}, p90 {fit.p90_rel_error:.1%}; "
          f"wrote {args.out}")
    return 0
