"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from conveyor.structured_outputs import StructuredOutputsParams

# Below this temperature sampling is greedy (argmax), as in vLLM.
_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    # The prompt tokens' logprobs (each given the ones before it) with this many top
    # alternatives; None: not computed (a request that asks skips the prefix cache).
    prompt_logprobs: int | None = None
    # OpenAI's logit_bias: token id -> a bias in [-100, 100] added to its logit.
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    # Scheduling hints that travel with the request (used by policies, never by the sampler).
    expected_output_tokens: int | None = None
    # What the output must match (a JSON schema, regex, choice, grammar); None: free text.
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the engine: token ids that end generation besides ``stop_token_ids``.
    eos_token_ids: frozenset[int] = field(default_factory=frozenset, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the offending field; called on construction."""
        _check(isinstance(self.n, int) and self.n >= 1, "n",
               f"must be an integer >= 1, got {self.n}")
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
               f"must be -1, 0 (disabled) or a positive integer, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"must be > 0, got {self.repetition_penalty}")
        if self.max_tokens is not None:
            _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
                   f"must be an integer >= 1, got {self.max_tokens}")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
               f"must be an integer >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None:
            _check(isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20, "logprobs",
                   f"must be an integer in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None:
            _check(isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20,
                   "prompt_logprobs",
                   f"must be an integer in [0, 20], got {self.prompt_logprobs}")
        if self.logit_bias:
            _check(all(isinstance(t, int) and t >= 0 for t in self.logit_bias), "logit_bias",
                   "keys must be token ids (non-negative integers)")
            _check(all(isinstance(b, (int, float)) and -100.0 <= b <= 100.0
                       for b in self.logit_bias.values()), "logit_bias",
                   "values must be in [-100, 100]")
        if self.seed is not None:
            _check(isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative integers")
        if self.structured_outputs is not None:
            # The grammar ends the output with EOS: a request that may not stop there
            # could not be both honoured and valid.
            _check(not self.ignore_eos, "ignore_eos", "cannot be set with structured_outputs")
            _check(self.min_tokens == 0, "min_tokens", "cannot be set with structured_outputs")
        if self.expected_output_tokens is not None:
            _check(self.expected_output_tokens >= 0, "expected_output_tokens",
                   f"must be >= 0, got {self.expected_output_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def clone(self, **changes) -> SamplingParams:
        new = copy.copy(self)
        for key, value in changes.items():
            setattr(new, key, value)
        return new


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")
