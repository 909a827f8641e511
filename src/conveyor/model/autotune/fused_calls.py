"""Decode-row times of the projections the fused decode step calls, taken the way it calls
them: one native loop over the kernels (``decode_linears_time`` in ``decode_forward.c``),
no Python or ctypes between the calls.

``linears.measure`` times a backend's module per call from Python. At the rows the fused
step takes (up to ``fused_decode.MAX_ROWS``) the step calls the layers' projections from
C instead, so a per-call cost that only the Python side pays (a gate/up projection whose
activation follows in torch ops, the call's own overhead) decides a choice that the step
does not see. ``measure`` times, in the same rotation as ``linears.measure`` (a copy of
every projection in layer order, each call's fastest of ``MEASURE_ROUNDS`` x
``ROTATION_PASSES``), the backends whose modules for every projection shape (not the LM
head, which runs outside the step) are ones the step calls, their calls interleaved; the
others get no time here.
"""

from __future__ import annotations

import numpy as np
import torch

from conveyor.kernels import cpu as kernels
from conveyor.model.autotune.linears import (
    MEASURE_ROUNDS,
    ROTATION_PASSES,
    rotation,
)
from conveyor.model.linear.shape import LinearShape
from conveyor.runner.fused_decode import MAX_ROWS, Unsupported, linear_row

ROWS_CAP = MAX_ROWS  # row counts up to which the step calls the projections from C


def _rows(backend, order: list[LinearShape], weights: dict[str, torch.Tensor]):
    """(table of linear rows, gate/up flags, the modules) for every call of ``order``, or
    None if a module of ``backend`` is not one the step calls."""
    rows, glu, keep, seen = [], [], [], set()
    for s in order:
        w = weights[s.key] if s.key not in seen else weights[s.key].clone()
        seen.add(s.key)
        mod = backend.make_linear(w, None, gate_up=s.gate_up)
        try:
            row, _, gemm = linear_row(mod)
        except Unsupported:
            return None
        rows.append(row)
        glu.append(int(s.gate_up))
        keep.append((mod, gemm))
    return (np.array(rows, dtype=np.int64).reshape(-1), np.array(glu, dtype=np.int32),
            keep)


@torch.inference_mode()
def measure(shapes: list[LinearShape], backends: dict[str, object], dtype: torch.dtype,
            rows: int, counts: dict[str, int] | None = None
            ) -> dict[str, dict[str, float]] | None:
    """Shape key -> backend name -> seconds a call at ``rows`` rows, for the projection
    shapes (LM heads left out) and the backends the step can call on all of them; None
    where the native kernels are off or fewer than two backends qualify."""
    lib = kernels.load()
    shapes = [s for s in shapes if not s.lm_head]
    if lib is None or not shapes or not hasattr(lib, "decode_linears_time"):
        return None
    gen = torch.Generator().manual_seed(0)
    weights = {s.key: (torch.randn(s.out_features, s.in_features, generator=gen) * 0.02).to(
        torch.bfloat16).to(dtype) for s in shapes}
    order = rotation(shapes, counts, dtype.itemsize)
    k_max = max(s.in_features for s in order)
    n_max = max(s.out_features for s in order)
    x = torch.randn(rows, k_max, generator=gen)
    y = torch.empty(rows, n_max)
    act = torch.empty(rows, n_max // 2 + 1)
    # Every backend's copies packed at once, their calls interleaved (call i of each
    # backend in turn, then call i + 1): a burst of the machine's other load hits them
    # alike; MEASURE_ROUNDS rounds, the backends' turn order reversed every other one.
    tables = {}
    for name in backends:
        table = _rows(backends[name], order, weights)
        if table is not None:
            tables[name] = table
    if len(tables) < 2:
        return None
    n, names = len(order), list(tables)
    glu = np.repeat(tables[names[0]][1], len(names))
    seconds = np.zeros(ROTATION_PASSES * n * len(names), dtype=np.float64)
    best = {name: np.full(n, np.inf) for name in names}  # each call's fastest
    for round_ in range(MEASURE_ROUNDS):
        turn = names if round_ % 2 == 0 else names[::-1]
        lins = np.stack([tables[name][0].reshape(n, -1) for name in turn], axis=1)
        lins = np.ascontiguousarray(lins).reshape(-1)
        rc = lib.decode_linears_time(lins.ctypes.data, n * len(turn), glu.ctypes.data, rows,
                                     x.data_ptr(), y.data_ptr(), act.data_ptr(),
                                     ROTATION_PASSES, seconds.ctypes.data)
        if rc:
            raise RuntimeError(f"decode_linears_time failed ({rc})")
        fastest = seconds.reshape(ROTATION_PASSES, n, len(turn)).min(axis=0)
        for i, name in enumerate(turn):
            best[name] = np.minimum(best[name], fastest[:, i])
    # A shape's time: the median over its calls of each call's fastest (a call that the
    # machine's other load held up in every turn moves it less than it would the mean).
    cols = {s.key: [i for i, o in enumerate(order) if o.key == s.key] for s in shapes}
    return {k: {name: float(np.median(best[name][c])) for name in names}
            for k, c in cols.items()}
