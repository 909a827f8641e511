"""conveyor: an LLM serving engine built around continuous batching and request scheduling.

Public names are imported lazily so that torch-free parts (the scheduler, the KV
manager, the simulator) can be imported without loading torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "conveyor.entrypoints.llm",
    "EngineArgs": "conveyor.config",
    "LoRARequest": "conveyor.config.lora",
    "SamplingParams": "conveyor.sampling_params",
    "CompletionOutput": "conveyor.outputs",
    "Logprob": "conveyor.outputs",
    "RequestMetrics": "conveyor.outputs",
    "RequestOutput": "conveyor.outputs",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'conveyor' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
