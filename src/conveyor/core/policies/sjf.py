"""Shortest job first by remaining work, with linear aging."""

from __future__ import annotations

from conveyor.config import PolicyConfig
from conveyor.core.policies.base import register_policy
from conveyor.core.policies.keyed import KeyedPolicy
from conveyor.core.policies.predictors import PREDICTORS, OutputLengthPredictor
from conveyor.request import Request


@register_policy
class SJFPolicy(KeyedPolicy):
    """Least remaining work first, where

        work = prompt_weight * tokens still to prefill + expected output tokens to generate

    and the expected output comes from a pluggable predictor (``sjf_predictor``: the
    request's ``expected_output_tokens`` hint, else ``max_tokens``), clamped to
    ``[1, max_tokens]``. A preempted request recomputes everything, so its prefill
    counts again. ``sjf_prompt_weight`` (default 1) prices a prompt token against an
    output token: prefill tokens share a step, each output token costs a step of its
    own, so engine time is closer to a weight well below 1 (step costs fitted on the CPU
    by benchmarks/scheduling/policies.py give 1/7 to 1/20). The aging bound holds for any weight.

    Aging. Without it (``sjf_aging_s = 0``) the key is ``(work, arrival)`` and a long
    request can wait forever under a stream of short ones. With ``A = sjf_aging_s > 0``
    the key is

        work / W + arrival / A          W = max_model_len, the largest possible work

    i.e. ``A`` seconds of waiting are worth ``W`` tokens of work. As ``0 < work <= W``, a
    request that arrived ``A`` or more seconds after another always sorts behind it:
    **no request is ever overtaken by one that arrived ``sjf_aging_s`` after it**, so its
    wait is bounded by the work that arrived before ``arrival + A``. Linear aging keeps
    the key fixed while a request waits (the ``-now / A`` term is the same for all), so
    the queue stays a heap: O(log n) per operation.

    Running requests get the step's token budget in the same order, so a short
    request's last prefill chunk is not held behind a long one's.
    """

    name = "sjf"

    def __init__(self, config: PolicyConfig | None = None,
                 predictor: OutputLengthPredictor | None = None) -> None:
        super().__init__(config)
        self.predictor = predictor or PREDICTORS[self.config.sjf_predictor]

    def remaining_work(self, request: Request) -> float:
        expected = min(max(int(self.predictor(request)), 1), request.max_tokens)
        to_generate = max(expected - request.num_output_tokens, 1)
        return self.config.sjf_prompt_weight * request.num_uncomputed_tokens + to_generate

    def key(self, request: Request, now: float) -> tuple[float, float]:
        work = self.remaining_work(request)
        aging = self.config.sjf_aging_s
        if aging <= 0:
            return (work, request.arrival_time)
        max_work = self.context.max_model_len
        if max_work is None:
            raise RuntimeError("sjf aging needs max_model_len: the scheduler binds it; "
                               "call policy.bind(PolicyContext(max_model_len=...)) first")
        return (min(work, max_work) / max_work + request.arrival_time / aging,
                request.arrival_time)

    def order_running(self, running: list[Request]) -> list[Request]:
        return sorted(running, key=self.remaining_work)
