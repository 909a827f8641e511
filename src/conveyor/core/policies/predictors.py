"""Output-length predictors for shortest-job-first, registered by name.

A predictor maps a request to the number of output tokens it is expected to
produce in total. The policy clamps the answer to ``[1, max_tokens]``, so a
predictor may be rough; a benchmark can register an oracle to bound what a
perfect predictor would win.
"""

from __future__ import annotations

from collections.abc import Callable

from conveyor.config.names import PREDICTOR_NAMES
from conveyor.request import Request

OutputLengthPredictor = Callable[[Request], int]


def predict_max_tokens(request: Request) -> int:
    """The worst case: the request runs to its ``max_tokens``."""
    return request.max_tokens


def predict_hint(request: Request) -> int:
    """The client's ``expected_output_tokens`` hint when it gives one, else ``max_tokens``."""
    hint = request.sampling_params.expected_output_tokens
    return hint if hint is not None else request.max_tokens


PREDICTORS: dict[str, OutputLengthPredictor] = {
    "hint": predict_hint,
    "max_tokens": predict_max_tokens,
}


def register_predictor(name: str, predictor: OutputLengthPredictor) -> None:
    PREDICTORS[name] = predictor
    PREDICTOR_NAMES.add(name)  # the config validates against these names
