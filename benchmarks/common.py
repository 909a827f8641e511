"""What more than one benchmark needs, in one module: where the repository and the shared
traces are, and a native kernel source as of another git revision, built with this
tree's flags for this CPU and loaded beside the process's own library (how a benchmark
times a kernel change's before and after in one run, where the machine's drift hits
both alike).

Scripts import it as ``benchmarks.common``, so they run from the repository root as
``python -m benchmarks.<topic>.<script>`` (see README.md)."""

from __future__ import annotations

import ctypes
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The traces (Azure conversation CSV, Mooncake JSONL) live beside the checkout, not in it.
SHARED_TRACES = os.path.normpath(os.path.join(REPO, "..", "shared", "traces"))
# Where the kernels folder lived before it became a package of its own: a revision from
# before the move is extracted from there.
OLD_KERNELS_DIR = "src/conveyor/model/kernels"


def traces_dir() -> str:
    """``$CONVEYOR_TRACES`` where set, else the shared traces folder."""
    return os.environ.get("CONVEYOR_TRACES", SHARED_TRACES)


def git_extract(rev: str, out_dir: str, path: str | None = None) -> str:
    """``path`` (the whole tree when None) of git revision ``rev`` of this repository,
    extracted under ``out_dir``; returns where it landed."""
    archive = subprocess.run(["git", "archive", rev, *([path] if path else [])], cwd=REPO,
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", out_dir], input=archive, check=True)
    return os.path.join(out_dir, path) if path else out_dir


def extract_at(rev: str, out_dir: str) -> str:
    """The kernels folder (``conveyor/kernels/cpu``, ``conveyor/model/kernels`` before it
    moved) of git revision ``rev``, extracted under ``out_dir``; returns its path."""
    from conveyor.kernels import cpu as kernels

    here = os.path.dirname(os.path.abspath(kernels.__file__))
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=here, check=True,
                         capture_output=True, text=True).stdout.strip()
    rel = os.path.relpath(here, top)
    listed = subprocess.run(["git", "ls-tree", "--name-only", rev, rel], cwd=top,
                            check=True, capture_output=True, text=True).stdout.strip()
    return git_extract(rev, out_dir, rel if listed else OLD_KERNELS_DIR)


def build_at(rev: str, source: str, out_dir: str, *also: str) -> ctypes.CDLL:
    """``source`` (a file of ``conveyor/kernels/cpu``, e.g. ``elementwise.c``) with the
    kernel headers of git revision ``rev``, built alone (with the sources ``also`` it
    calls into, e.g. ``prefill_attention_amx.c``) into a library whose functions get their
    C types (``kernels.SIGNATURES``)."""
    from conveyor.kernels import cpu as kernels

    src_dir = extract_at(rev, out_dir)
    so = os.path.join(out_dir, source.replace(".c", ".so"))
    flags = [*kernels._FLAGS, *kernels._isa_flags(kernels.kernel_isa())]
    sources = [os.path.join(src_dir, name) for name in (source, *also)]
    subprocess.run([kernels.find_compiler() or "cc", *flags, "-shared", *sources, "-o", so,
                    *kernels._LIBS], check=True)
    lib = ctypes.CDLL(so)
    kernels.bind(lib, only_present=True)
    return lib


class Overlay:
    """A loaded library with some of its functions taken from another (``build_at``'s):
    set as ``ops._lib``, every native op keeps this tree's kernels except ``names``."""

    def __init__(self, base: ctypes.CDLL, other: ctypes.CDLL, names: tuple[str, ...]) -> None:
        self._base, self._other, self._names = base, other, frozenset(names)

    def __getattr__(self, name: str):
        return getattr(self._other if name in self._names else self._base, name)


GEMM_FUNCTIONS = ("gemm_f32", "gemm_f32_w16")


def gemm_at(rev: str) -> Overlay:
    """The process's own kernels with git revision ``rev``'s native GEMM: set as
    ``ops._lib``, every ``PackedGemm`` call runs REV's ``gemm.c``."""
    import tempfile

    from conveyor.kernels.cpu import ops

    return Overlay(ops._lib or ops._native(), build_at(rev, "gemm.c", tempfile.mkdtemp()),
                   GEMM_FUNCTIONS)


def start_decoding(llm, batch: int, context: int, max_tokens: int = 100_000) -> None:
    """Add ``batch`` greedy requests of ``context`` random prompt tokens to ``llm`` (an
    ``LLM``) and step until every prompt is in the cache and one pure decode step ran: the
    engine is then in the decode steady state that decode-step benchmarks time."""
    import random

    from conveyor import SamplingParams

    rng = random.Random(0)
    for i in range(batch):
        prompt = [rng.randrange(10, 1000) for _ in range(context)]
        llm.engine.add_request({"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                              temperature=0.0), request_id=str(i))
    while llm.engine.scheduler.num_waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in llm.engine.scheduler.running):
        llm.engine.step()
    llm.engine.step()  # the first pure decode step


def median_step_s(llm, n: int) -> float:
    """The median wall time of ``n`` engine steps of ``llm``, in seconds."""
    import statistics
    import time

    times = []
    for _ in range(n):
        t = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times)
