"""Cost model fitted to step times measured on a real machine (``conveyor profile``).

The fit is a small linear regression on features that each stand for one cost of
a step, with non-negative coefficients (a cost cannot make a step faster):

    step_s = c_step                            fixed per step (Python, launches)
           + c_matrix * [T >= 2]               matrix-matrix products instead of vectors
           + c_row    * rows                   per request in the batch (inputs, update)
           + c_token  * T                      linear layers, per token
           + c_small  * min(T, small_knee)     ... the first tokens cost more
           + c_knee   * max(0, T - knee)       ... piecewise: the slope after the knee
           + c_pair   * P                      prefill attention, per query-key pair
           + c_decode * C                      decode attention: C = KV tokens read
           + c_sample * S                      LM head and sampler, per sampled row
           + c_prow   * prefill rows           per prefill chunk (its own attention call)
           + c_prior  * prior                  KV tokens computed before the chunks (gathered)

The matrix term is a step up between one token and two: a one-token step multiplies
each weight matrix by a vector (GEMV, which streams the weights once), while two or
more tokens go through a GEMM kernel that packs the weights first; without the term
the fit splits the difference and errs on both sides of it.

The last three terms are what a step holding a prefill costs beyond its tokens, and
without them the fit had prefill steps systematically short. The first tokens of a
step cost more than the later ones (a GEMM's row blocks fill up): a decode step of
many rows still comes out right, its sampled rows soaking up the difference, but a
prefill of as many tokens (one sampled row) is predicted short, and so are the TTFTs
made of such steps. The hinge ``min(T, small_knee)`` bends the token cost the other way from
``knee`` (concave; both knees are searched), the sampled rows' cost drops to what the
LM head takes, and those prefills come out right. Each prefill chunk runs its own
attention call per layer, and a chunk that continues a prompt (chunked prefill, a
prefix-cache hit) gathers its prior context's K/V from the cache and masks it, far
more than its query-key pairs explain. ``conveyor profile`` times such continuations
(a prompt after its own cached prefix) so the term has data.

The decode term follows the runner's decode kernel (``decode_layout``, recorded by
``conveyor profile``): ``paged`` (the native CPU kernel, like a paged-attention GPU
kernel) reads each row's own context, C = the sum of the contexts; ``padded`` (the
SDPA path) gathers every row padded to the longest, C = B * max_ctx.

The hinge ``max(0, T - knee)`` makes the token cost piecewise linear: below the
knee a step is bound by reading the weights (flat-ish in T), above it by compute.
The knees are searched over the samples' distinct token counts (thinned to a few
dozen for a fit to a real run's thousands of steps): ``knee`` with no small knee,
then ``small_knee`` (up to 64 tokens, or none), then ``knee`` again, until neither
moves. Residuals are relative (each sample weighted by 1/time), so short decode steps
count as much as long prefills. Repeated samples of one shape (``--repeats``)
count once, at their median: the simulator must predict what a step typically
costs, since that is what a real run's latencies add up, and the median of three
ignores one repeat slowed by another process (the fastest repeat is the luckiest
one, below the typical step of real runs, and simulated TPOTs come out low). Shapes
more than 4 median-absolute-deviations off the first fit (most of whose repeats were
slowed) are dropped before the final fit.

Profiles are versioned (``PROFILE_FORMAT``); one of ``conveyor-profile/1`` (the first
eight terms) still loads, with the new terms at zero: it predicts what it did.

Loading profile.json needs numpy only: no torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np

from conveyor.config import ModelConfig
from conveyor.costs.shape import BatchShape

FEATURES = ("step", "matrix", "rows", "tokens", "tokens_over_knee", "prefill_attention",
            "decode_attention", "sampled", "tokens_under_small_knee", "prefill_rows",
            "prefill_prior")
PROFILE_FORMAT = "conveyor-profile/2"
# Format 1 fitted the first eight terms; its profiles load with the others at zero.
_V1 = ("conveyor-profile/1", FEATURES[:8])
_MAX_SMALL_KNEE = 64  # the first-tokens hinge is about small GEMMs, not the compute knee
_MAX_KNEE_CANDIDATES = 32  # a real run's steps have hundreds of distinct token counts
# ModelConfig fields a profile must match to be used for another run.
_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "vocab_size", "dtype")


DECODE_LAYOUTS = ("paged", "padded")


def features(b: BatchShape, knee: float, paged: bool = True,
             small_knee: float = 0.0) -> list[float]:
    tokens = b.num_prefill_tokens + b.num_decodes
    return [1.0, 1.0 if tokens >= 2 else 0.0, float(b.num_prefills + b.num_decodes),
            float(tokens), max(0.0, tokens - knee), float(b.prefill_attention),
            float(b.decode_context if paged else b.num_decodes * b.max_decode_context),
            float(b.num_sampled), float(min(tokens, small_knee)), float(b.num_prefills),
            float(b.prefill_context - b.num_prefill_tokens)]


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 200) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 1e-12 * max(1.0, float(np.abs(a).max()))
    for _ in range(max_iter):
        w = a.T @ (b - a @ x)
        candidates = ~passive & (w > tol)
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, w, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x


@dataclass
class StepFit:
    knee: float
    coefficients: dict[str, float]
    median_rel_error: float
    p90_rel_error: float
    num_samples: int
    num_dropped: int  # distinct shapes left out of the final fit as outliers
    decode_layout: str = "paged"  # what the decode term counts (DECODE_LAYOUTS)
    small_knee: float = 0.0  # of the first-tokens hinge; 0: none (format 1 profiles)


def _solve(shapes: list[BatchShape], times: np.ndarray, knee: float, paged: bool,
           small_knee: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    x = np.array([features(s, knee, paged, small_knee) for s in shapes])
    w = 1.0 / times  # relative residuals
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    coef = nnls(x * w[:, None] / scale, times * w) / scale
    rel = (x @ coef - times) / times
    return coef, rel


def fit_step_times(shapes: list[BatchShape], times: list[float],
                   decode_layout: str = "paged") -> StepFit:
    """Fit the step-time model; samples of one shape (repeats) count once, at their median.

    ``decode_layout``: ``paged`` if the runner's decode attention reads each row's own
    context, ``padded`` if it pads every row to the longest.
    """
    if decode_layout not in DECODE_LAYOUTS:
        raise ValueError(f"decode_layout must be one of {DECODE_LAYOUTS}, got {decode_layout!r}")
    paged = decode_layout == "paged"
    if len(shapes) != len(times):
        raise ValueError(f"{len(shapes)} shapes but {len(times)} times")
    if any(t <= 0 for t in times):
        raise ValueError("step times must be positive")
    by_shape: dict[BatchShape, list[float]] = {}
    for shape, t in zip(shapes, times):
        by_shape.setdefault(shape, []).append(t)
    shapes = list(by_shape)
    # As many distinct shapes as terms they exercise (a grid without prefills leaves the
    # prefill terms at zero, whatever their coefficients).
    seen = (np.array([features(s, 0.0, paged, _MAX_SMALL_KNEE) for s in shapes]) != 0)
    need = int(seen.any(axis=0).sum())
    if len(shapes) < need:
        raise ValueError(f"need at least {need} distinct batch shapes to fit, "
                         f"got {len(shapes)}")
    y = np.array([float(np.median(ts)) for ts in by_shape.values()])
    tokens = _knee_candidates(sorted({s.num_prefill_tokens + s.num_decodes for s in shapes}))
    knees = [0.0, *tokens[:-1]]
    small_knees = [0.0, *(t for t in tokens[:-1] if t <= _MAX_SMALL_KNEE)]

    def best(keep: np.ndarray) -> tuple[float, float, np.ndarray, np.ndarray]:
        kept = [s for s, k in zip(shapes, keep) if k]
        tried: dict[tuple[float, float], tuple[float, np.ndarray, np.ndarray]] = {}

        def solve(knee: float, small: float) -> float:
            if (knee, small) not in tried:
                coef, rel = _solve(kept, y[keep], knee, paged, small)
                tried[knee, small] = (float(np.mean(rel ** 2)), coef, rel)
            return tried[knee, small][0]

        # Coordinate search (one knee at a time until neither moves): a fit to a real
        # run's thousands of steps cannot afford every pair.
        knee, small = min(knees, key=lambda k: solve(k, 0.0)), 0.0
        for _ in range(4):
            small = min(small_knees, key=lambda k: solve(knee, k))
            new_knee = min(knees, key=lambda k: solve(k, small))
            if new_knee == knee:
                break
            knee = new_knee
        _, coef, rel = tried[knee, small]
        return knee, small, coef, rel

    keep = np.ones(len(y), dtype=bool)
    knee, small, coef, rel = best(keep)
    # A shape within ~3% of the fit is never an outlier, however exact the others are
    # (with a near-perfect fit, rounding alone would otherwise decide what is dropped).
    mad = max(float(np.median(np.abs(rel - np.median(rel)))), 0.005)
    keep = np.abs(rel - np.median(rel)) <= 4 * mad * 1.4826
    if keep.sum() >= need:
        knee, small, coef, rel = best(keep)
    abs_rel = np.abs(rel)
    return StepFit(knee=knee, coefficients=dict(zip(FEATURES, map(float, coef))),
                   median_rel_error=float(np.median(abs_rel)),
                   p90_rel_error=float(np.percentile(abs_rel, 90)),
                   num_samples=len(times), num_dropped=int((~keep).sum()),
                   decode_layout=decode_layout, small_knee=small)


def _knee_candidates(tokens: list[int]) -> list[float]:
    """The distinct token counts, or ~_MAX_KNEE_CANDIDATES of them spread geometrically
    (every small count, fewer large ones) when there are more."""
    if len(tokens) <= _MAX_KNEE_CANDIDATES:
        return [float(t) for t in tokens]
    picks = np.unique(np.geomspace(1, len(tokens), _MAX_KNEE_CANDIDATES).astype(int) - 1)
    return [float(tokens[i]) for i in sorted({*picks, len(tokens) - 1})]


class ProfileCostModel:
    """Evaluates a fitted profile; ``load`` reads profile.json (numpy only, no torch)."""

    def __init__(self, fit: StepFit, *, model: dict, device: str, kv_cache_memory: int,
                 meta: dict | None = None) -> None:
        self.fit = fit
        self.model = model  # the profiled model's shape (_SHAPE_FIELDS) and name
        self.device = device
        self.cap_kv_to_useful = device != "cuda"
        self._kv_cache_memory = kv_cache_memory
        self.meta = meta or {}
        self._coef = [fit.coefficients[name] for name in FEATURES]
        self._knee = fit.knee
        self._small_knee = fit.small_knee
        self._paged = fit.decode_layout == "paged"

    def step_time(self, b: BatchShape) -> float:
        c = self._coef
        tokens = b.num_prefill_tokens + b.num_decodes
        return (c[0] + (c[1] if tokens >= 2 else 0.0) + c[2] * (b.num_prefills + b.num_decodes)
                + c[3] * tokens + c[4] * max(0.0, tokens - self._knee)
                + c[5] * b.prefill_attention
                + c[6] * (b.decode_context if self._paged else b.num_decodes * b.max_decode_context)
                + c[7] * b.num_sampled + c[8] * min(tokens, self._small_knee)
                + c[9] * b.num_prefills + c[10] * (b.prefill_context - b.num_prefill_tokens))

    def kv_cache_memory(self, model: ModelConfig) -> int:
        return self._kv_cache_memory

    def describe(self) -> str:
        return (f"profile of {self.model.get('name')} on {self.device} "
                f"(median fit error {self.fit.median_rel_error:.1%}, "
                f"{self.fit.decode_layout} decode attention)")

    def check_model(self, model: ModelConfig) -> None:
        """ValueError if ``model`` differs in shape from the profiled one."""
        diffs = [f"{name} {getattr(model, name)} vs {self.model.get(name)}"
                 for name in _SHAPE_FIELDS if getattr(model, name) != self.model.get(name)]
        if diffs:
            raise ValueError(f"the profile was measured for {self.model.get('name')!r}, "
                             f"another shape than {model.served_model_name!r}: "
                             f"{'; '.join(diffs)}")

    # ---- file ----------------------------------------------------------------------------
    def to_json(self, samples: list[tuple[BatchShape, float]] | None = None) -> dict:
        return {"format": PROFILE_FORMAT, "model": self.model, "device": self.device,
                "kv_cache_memory": self._kv_cache_memory, "features": list(FEATURES),
                "fit": asdict(self.fit), "meta": self.meta,
                "samples": [{**s._asdict(), "seconds": t} for s, t in samples or []]}

    def save(self, path: str, samples: list[tuple[BatchShape, float]] | None = None) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(samples), f, indent=1)

    @classmethod
    def load(cls, path: str) -> ProfileCostModel:
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read profile {path}: {e}") from None
        fmt = data.get("format") if isinstance(data, dict) else None
        if fmt not in (PROFILE_FORMAT, _V1[0]):
            raise ValueError(f"{path} is not a profile written by `conveyor profile` "
                             f"(expected format {PROFILE_FORMAT!r} or {_V1[0]!r}, "
                             f"got {fmt!r})")
        expected = FEATURES if fmt == PROFILE_FORMAT else _V1[1]
        if tuple(data.get("features", ())) != expected:
            raise ValueError(f"{path}: profile features {data.get('features')} differ from "
                             f"{fmt}'s {list(expected)}; profile again")
        fit = StepFit(**data["fit"])
        # A format-1 profile: the terms it did not fit cost nothing, as they did then.
        fit.coefficients = {name: float(fit.coefficients.get(name, 0.0)) for name in FEATURES}
        return cls(fit, model=data["model"], device=data["device"],
                   kv_cache_memory=int(data["kv_cache_memory"]), meta=data.get("meta"))

    @staticmethod
    def model_fields(model: ModelConfig, name: str) -> dict:
        return {"name": name, **{f: getattr(model, f) for f in _SHAPE_FIELDS}}
