"""A mixture-of-experts block's routing and combine in two native calls
(``moe_route.c``): its own small library, built and cached as the main one is, with IEEE
arithmetic as written (no fast-math, no FMA contraction) so that its values are torch's
bits.

``route`` checks every argument before handing pointers to C and returns None where the
kernel declines (a tie at a row's k-th probability, a NaN): the caller then takes its
torch path. ``load()`` is None where the kernels are off (``CONVEYOR_NATIVE_KERNELS=0``)
or cannot be built.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import subprocess
from dataclasses import dataclass

import torch

from conveyor.kernels import cpu as kernels
from conveyor.kernels.cpu import small_library

logger = logging.getLogger(__name__)

_SOURCE = os.path.join(os.path.dirname(__file__), "moe_route.c")
_PTR, _I32, _I64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
# After the kernels' flags, so these win: products and sums rounded as written.
_IEEE = ["-fno-fast-math", "-ffp-contract=off"]
F32, I32 = torch.float32, torch.int32


@functools.cache
def load_variant(isa: str) -> ctypes.CDLL | None:
    """The library built for ``isa`` (``kernels.ISA_FLAGS``); None if it does not build."""
    if platform.system() != "Linux":
        return None
    flags = [*kernels._FLAGS, *kernels._isa_flags(isa), *_IEEE]
    try:
        lib = small_library.build("moe-route", _SOURCE, flags)
    except (OSError, subprocess.CalledProcessError) as e:
        logger.warning("the MoE routing kernel disabled: %s",
                       (getattr(e, "stderr", "") or str(e)).strip()[:500])
        return None
    lib.moe_route_f32.restype = ctypes.c_int
    lib.moe_route_f32.argtypes = [_I32, _I32, _I32, _PTR, _I64, _I32, _PTR, _I64, _I32, _PTR,
                                  _PTR, _PTR, _PTR, _PTR, _PTR]
    lib.moe_combine_f32.restype = ctypes.c_int
    lib.moe_combine_f32.argtypes = [_I32, _I32, _I32, _PTR, _I64, _PTR, _PTR, _PTR]
    lib.moe_route_max_k.restype = ctypes.c_int
    lib.moe_route_max_k.argtypes = []
    return lib


def load() -> ctypes.CDLL | None:
    """This CPU's build (capped by ``CONVEYOR_KERNEL_ISA``); None where kernels are off
    or it does not build."""
    if not kernels.native_kernels_enabled():
        return None
    return load_variant(kernels.kernel_isa())


@dataclass
class Routed:
    """A batch's routing: per row its top-k expert ids [T, k] and weights [T, k]; per
    (slot, token) pair, grouped by expert (expert e's pairs at ``starts[e]`` ..
    ``starts[e + 1]``), its token, weight and gathered row of x."""

    top_ids: torch.Tensor  # int32 [T, k]
    top_weights: torch.Tensor  # float32 [T, k]
    starts: torch.Tensor  # int32 [E + 1]
    tokens: torch.Tensor  # int32 [T k]
    pair_weights: torch.Tensor  # float32 [T k]
    rows: torch.Tensor  # float32 [T k, H]


def route(probs: torch.Tensor, x: torch.Tensor, k: int, renormalize: bool,
          lib: ctypes.CDLL) -> Routed | None:
    """The top-k routing of float32 ``probs`` [T, E] (the router's softmax) over float32
    ``x`` [T, H], as transformers computes it; None where the kernel declines (a tie at
    some row's k-th probability, or a NaN; renormalising k weights where its sum would
    round otherwise than torch's, ``sums_as_torch``): take torch's ops then."""
    ok = (probs.dtype is F32 and x.dtype is F32 and probs.dim() == 2 and x.dim() == 2
          and probs.device.type == "cpu" and x.device.type == "cpu"
          and probs.stride(1) == 1 and x.stride(1) == 1 and probs.shape[0] == x.shape[0]
          and 1 <= k <= min(probs.shape[1], int(lib.moe_route_max_k())))
    if not ok:
        raise ValueError(
            "conveyor::moe_route: probs must be float32 [T, E] and x float32 [T, H] on CPU "
            f"with unit column stride, 1 <= k <= min(E, {int(lib.moe_route_max_k())}) (got "
            f"probs {probs.dtype} {tuple(probs.shape)}, x {x.dtype} {tuple(x.shape)}, k {k})")
    if renormalize and k > 1 and not sums_as_torch(k, lib):
        return None
    return _route(probs, x, k, renormalize, lib)


def _route(probs: torch.Tensor, x: torch.Tensor, k: int, renormalize: bool,
           lib: ctypes.CDLL) -> Routed | None:
    (t, e), h = probs.shape, x.shape[1]
    r = Routed(torch.empty(t, k, dtype=I32), torch.empty(t, k, dtype=F32),
               torch.empty(e + 1, dtype=I32), torch.empty(t * k, dtype=I32),
               torch.empty(t * k, dtype=F32), torch.empty(t * k, h, dtype=F32))
    rc = lib.moe_route_f32(t, e, k, probs.data_ptr(), probs.stride(0), int(renormalize),
                           x.data_ptr(), x.stride(0), h, r.top_ids.data_ptr(),
                           r.top_weights.data_ptr(), r.starts.data_ptr(), r.tokens.data_ptr(),
                           r.pair_weights.data_ptr(), r.rows.data_ptr())
    if rc == 1:
        return None
    if rc != 0:
        raise MemoryError("conveyor::moe_route: out of memory")
    return r


@functools.cache
def sums_as_torch(k: int, lib: ctypes.CDLL) -> bool:
    """Whether the kernel's renormalising sum of k weights (left to right) rounds as
    torch's ``sum(dim=-1)`` does here, checked once per k on random rows: torch's order
    over a short last dimension depends on its length (and may on its build and CPU);
    where it differs, the block renormalises with torch."""
    g = torch.Generator().manual_seed(k)
    probs = torch.softmax(torch.randn(512, k + 3, generator=g) * 3.0, dim=-1)
    routed = _route(probs, torch.zeros(512, 1), k, True, lib)
    weights = torch.topk(probs, k, dim=-1).values
    return routed is not None and torch.equal(
        routed.top_weights, weights / weights.sum(dim=-1, keepdim=True))


def combine(h: torch.Tensor, routed: Routed, lib: ctypes.CDLL) -> torch.Tensor:
    """[T, H]: each pair's expert output (``h`` [T k, H] float32, the pairs in ``routed``'s
    order) times its weight, added into its token's row pair after pair."""
    t, pairs = routed.top_ids.shape[0], routed.tokens.shape[0]
    hidden = routed.rows.shape[1]
    if not (h.dtype is F32 and h.dim() == 2 and h.device.type == "cpu" and h.stride(1) == 1
            and tuple(h.shape) == (pairs, hidden)):
        raise ValueError(f"conveyor::moe_combine: h must be float32 [{pairs}, {hidden}] on "
                         f"CPU with unit column stride, got {h.dtype} {tuple(h.shape)}")
    out = torch.empty(t, hidden, dtype=F32)
    if lib.moe_combine_f32(t, hidden, pairs, h.data_ptr(), h.stride(0),
                           routed.tokens.data_ptr(), routed.pair_weights.data_ptr(),
                           out.data_ptr()) != 0:
        raise ValueError("conveyor::moe_combine: a token outside the batch")
    return out
