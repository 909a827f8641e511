"""conveyor: an LLM serving engine built around continuous batching and request scheduling."""

from conveyor.config import EngineArgs
from conveyor.entrypoints.llm import LLM
from conveyor.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from conveyor.sampling_params import SamplingParams

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
