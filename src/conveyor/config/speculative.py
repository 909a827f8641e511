"""``speculative_config``, shaped like vLLM's: which proposer, how many draft tokens.

Torch-free: the scheduler (draft lengths) and the runner (proposers, verification)
both read it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "suffix", "draft_model", "synthetic")
SUFFIX_BACKENDS = ("auto", "native", "python")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    # The most draft tokens a request verifies in one step (k).
    num_speculative_tokens: int = 4
    # On (default): k is chosen per request per step by expected benefit against the
    # measured cost of one more token (spec/controller.py). Off: always k (as vLLM).
    adaptive: bool = True
    # ngram: the longest and shortest suffix looked up in the request's own context.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # draft_model: a Hugging Face checkpoint sharing the target's tokenizer.
    model: str | None = None
    # suffix (SuffixDecoding): tree depth, finished requests kept, the lowest estimated
    # probability a draft token may have, and the draft length per matched token.
    suffix_max_depth: int = 32
    suffix_max_cached_requests: int = 1000
    suffix_min_token_prob: float = 0.1
    suffix_max_spec_factor: float = 1.0
    # ... and whose trees: "native" (Arctic Inference's, C++: spec/suffix_native.py),
    # "python" (spec/suffix.py), or "auto" (native where arctic_inference imports).
    suffix_backend: str = "auto"
    # synthetic (benchmarks only, not lossless): each draft token is accepted with this
    # probability given the ones before it were, whatever the target says. The simulator
    # (any method) draws accepted lengths from it, or from one rate per position.
    acceptance_rate: float | tuple[float, ...] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        _check(self.method in METHODS, "method",
               f"must be one of {', '.join(METHODS)}, got {self.method!r}")
        _check(isinstance(self.num_speculative_tokens, int)
               and 1 <= self.num_speculative_tokens <= 16, "num_speculative_tokens",
               f"must be an integer in [1, 16], got {self.num_speculative_tokens!r}")
        _check(isinstance(self.prompt_lookup_min, int) and self.prompt_lookup_min >= 1,
               "prompt_lookup_min", f"must be an integer >= 1, got {self.prompt_lookup_min!r}")
        _check(isinstance(self.prompt_lookup_max, int)
               and self.prompt_lookup_max >= self.prompt_lookup_min, "prompt_lookup_max",
               f"must be an integer >= prompt_lookup_min ({self.prompt_lookup_min}), "
               f"got {self.prompt_lookup_max!r}")
        _check(self.suffix_max_depth >= 1, "suffix_max_depth",
               f"must be >= 1, got {self.suffix_max_depth}")
        _check(self.suffix_max_cached_requests >= 0, "suffix_max_cached_requests",
               f"must be >= 0, got {self.suffix_max_cached_requests}")
        _check(0.0 <= self.suffix_min_token_prob <= 1.0, "suffix_min_token_prob",
               f"must be in [0, 1], got {self.suffix_min_token_prob}")
        _check(self.suffix_max_spec_factor > 0, "suffix_max_spec_factor",
               f"must be > 0, got {self.suffix_max_spec_factor}")
        _check(self.suffix_backend in SUFFIX_BACKENDS, "suffix_backend",
               f"must be one of {', '.join(SUFFIX_BACKENDS)}, got {self.suffix_backend!r}")
        if self.method == "draft_model":
            _check(isinstance(self.model, str) and bool(self.model), "model",
                   "is required for method 'draft_model' (a Hugging Face checkpoint folder)")
        rate = self.acceptance_rate
        if self.method == "synthetic" or rate is not None:
            rates = list(rate) if isinstance(rate, list | tuple) else [rate]
            _check(bool(rates) and all(isinstance(r, int | float) and math.isfinite(r)
                                       and 0 <= r <= 1 for r in rates), "acceptance_rate",
                   f"must be a rate in [0, 1] (or one per position) for method "
                   f"'{self.method}', got {rate!r}")
            _check(self.method != "synthetic" or not isinstance(rate, list | tuple),
                   "acceptance_rate", "must be one rate for method 'synthetic'")
            if isinstance(rate, list):
                object.__setattr__(self, "acceptance_rate", tuple(rate))

    @classmethod
    def from_dict(cls, value: dict[str, Any] | str | SpeculativeConfig | None
                  ) -> SpeculativeConfig | None:
        """From ``LLM(speculative_config={...})`` or ``--speculative-config '<json>'``."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be an object, got {type(value).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(names))}")
        if "method" not in value:
            raise ValueError(f"speculative_config needs a 'method' ({', '.join(METHODS)})")
        return cls(**value)

    @property
    def writes_draft_kv(self) -> bool:
        """Whether proposing writes K/V (a draft model): drafts then need slots reserved."""
        return self.method == "draft_model"


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"speculative_config.{name} {message}")
