"""conveyor: an LLM serving engine built around continuous batching and request scheduling."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from conveyor.config import EngineArgs
from conveyor.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from conveyor.sampling_params import SamplingParams

if TYPE_CHECKING:
    from conveyor.entrypoints.llm import LLM

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "Logprob",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # ``LLM`` pulls in torch and the runner: loaded on first use, so that the torch-free
    # parts (scheduler, KV manager, simulator) can be imported without it.
    if name == "LLM":
        from conveyor.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
