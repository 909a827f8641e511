"""A Gemma-2-shaped decode step (the peers table's ``gemma2`` shape, dummy weights) side by
side with the same step where the attention logit cap runs in ``softcap.py`` (torch)
instead of the native kernels, where GeGLU and the final logit cap run in torch too (the
path before they were native), and with a Llama of the same dimensions (no caps, no
window, SiLU, plain norms), in one process: rounds alternate the arms so machine noise
hits each; the median step of each (its best round) is printed with the ratios, and
where each step's time goes (each part's entry point wrapped and summed per step). With
``--threads 1`` the clock is the thread's CPU time, which another process's load inflates
far less than wall time does (on a shared machine, use it); with more threads, wall time.

    python -m benchmarks.steps.gemma2_decode --batch 16 --context 200 --threads 1
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time

import torch

from benchmarks.common import start_decoding
from benchmarks.peers.shapes import GEMMA2
from conveyor import LLM
from conveyor.config.presets import write_checkpoint_files
from conveyor.kernels.cpu.cpuinfo import cpu_model_name
from conveyor.model.attention.native_decode import NativeDecode
from conveyor.model.attention.native_prefill import NativePrefill
from conveyor.model.layers.ops import NativeOps, TorchOps

# Gemma 2's dimensions as a Llama: what the same projections and attention cost without
# Gemma's extras (caps, windows, GELU-tanh, sandwich norms, embedding scale).
LLAMA = {k: v for k, v in GEMMA2.items()
         if k not in ("query_pre_attn_scalar", "attn_logit_softcapping",
                      "final_logit_softcapping", "sliding_window", "hidden_activation")}
LLAMA.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu")

PARTS: collections.Counter = collections.Counter()
CLOCK = [time.perf_counter]


def _wrap(owner, name: str, label: str) -> None:
    fn = getattr(owner, name)

    def timed(*args, **kwargs):
        t = CLOCK[0]()
        try:
            return fn(*args, **kwargs)
        finally:
            PARTS[label] += CLOCK[0]() - t

    setattr(owner, name, timed)


def instrument() -> None:
    from conveyor.model.layers import ops
    from conveyor.model.linear import native
    from conveyor.model.models import decoder

    _wrap(native.NativeLinear, "forward", "projections + LM head")
    _wrap(decoder, "paged_attention", "attention (KV write + kernel)")
    for name in ("add_rms_norm", "rms_norm", "rope_", "silu_mul", "gelu_tanh_mul", "softcap"):
        _wrap(ops.NativeOps, name, f"elementwise: {name}")
    _wrap(decoder.DecoderForCausalLM, "compute_logits", "LM head + final cap")
    _wrap(decoder.DecoderForCausalLM, "forward", "model forward (layers)")


NATIVE_EXTRAS: dict = {}  # NativeOps' own (timed) methods, taken once instrumented


def set_native(attention_cap: bool, extras: bool) -> None:
    """Whether capped layers run the cap in the native kernels (else softcap.py), and
    whether GeGLU and the final logit cap run natively (else in torch, as TorchOps)."""
    NativeDecode.takes_softcap = attention_cap
    NativePrefill.takes_softcap = attention_cap
    for name, fn in NATIVE_EXTRAS.items():
        setattr(NativeOps, name, fn if extras else getattr(TorchOps, name))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-parts", action="store_true", help="time the steps only")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = CLOCK[0] = time.thread_time if args.threads == 1 else time.perf_counter
    if not args.no_parts:
        instrument()
    NATIVE_EXTRAS.update({name: getattr(NativeOps, name) for name in ("gelu_tanh_mul",
                                                                       "softcap")})
    root = tempfile.mkdtemp(prefix="conveyor-gemma2-step-")
    llms = {}
    for name, cfg in (("gemma2", GEMMA2), ("llama", LLAMA)):
        path = f"{root}/{name}"
        write_checkpoint_files(path, cfg)
        llms[name] = LLM(path, dtype="float32", load_format="dummy", max_num_seqs=args.batch,
                         max_num_batched_tokens=max(512, args.batch * args.context),
                         enable_prefix_caching=False)
        start_decoding(llms[name], args.batch, args.context)
    arms = {"gemma2": ("gemma2", True, True),
            "gemma2, attention cap in softcap.py": ("gemma2", False, True),
            "gemma2, all in torch (before)": ("gemma2", False, False),
            "llama same dims": ("llama", True, True)}
    best: dict[str, tuple[float, dict[str, float]]] = {}
    for r in range(args.rounds):
        for arm in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            name, attention_cap, extras = arms[arm]
            set_native(attention_cap, extras)
            PARTS.clear()
            times = []
            for _ in range(args.steps):
                t = clock()
                llms[name].engine.step()
                times.append(clock() - t)
            med = statistics.median(times)
            if arm not in best or med < best[arm][0]:
                best[arm] = (med, {k: s / args.steps for k, s in PARTS.items()})
    set_native(True, True)
    print(f"# Gemma-2 shape decode step, batch {args.batch}, context {args.context}+, "
          f"{args.threads} threads ({'thread CPU' if args.threads == 1 else 'wall'} time), "
          f"{cpu_model_name()}; median ms per step (share of the step)")
    labels = sorted({k for _, parts in best.values() for k in parts})
    print("| part | " + " | ".join(best) + " |")
    print("|---|" + "---:|" * len(best))
    print("| **step** | " + " | ".join(f"**{1e3 * best[a][0]:.2f}**" for a in best) + " |")
    for label in labels:
        cells = []
        for arm in best:
            step, parts = best[arm]
            ms = 1e3 * parts.get(label, 0.0)
            cells.append(f"{ms:.2f} ({100 * ms / (1e3 * step):.0f}%)")
        print(f"| {label} | " + " | ".join(cells) + " |")
    now, torch_cap, before, llama = (best[a][0] for a in arms)
    print(f"\nattention cap in softcap.py / in C: {torch_cap / now:.2f}x; all in torch "
          f"(before) / now: {before / now:.2f}x; gemma2 / llama: {now / llama:.2f}x")


if __name__ == "__main__":
    main()
