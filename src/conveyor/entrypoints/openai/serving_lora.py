"""The server's adapters: names a request's ``model`` may take, loaded and unloaded at run
time (vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``).

Each name maps to a ``LoRARequest`` with an id never reused (a name loaded again after an
unload gets a new id, so no stale weights or cached K/V are ever taken for it). The
``--lora-modules`` adapters take ids 1, 2, ... in order, as the runner preloads them.
Unloading removes the name at once (new requests naming it get 404); requests already
in flight carry their ``LoRARequest`` and finish with it (the runner never drops an
adapter a live request uses; it drops unused ones, least recently used first, when it
needs room for another).
"""

from __future__ import annotations

from typing import Any

from conveyor.config.lora import LoRAConfig, LoRARequest, check_adapter
from conveyor.entrypoints.openai.errors import OpenAIError


class LoRARegistry:
    def __init__(self, config: LoRAConfig) -> None:
        self.config = config
        self.adapters: dict[str, LoRARequest] = {}
        self._next_id = 1
        for name, path in config.modules:
            self.load(name, path)

    def load(self, name: str, path: str) -> LoRARequest:
        """400 for a name in use, a missing file, a rank above the maximum."""
        if name in self.adapters:
            raise OpenAIError(400, f"the adapter {name!r} is already loaded",
                              param="lora_name")
        try:
            check_adapter(path, self.config.max_lora_rank)
        except (ValueError, OSError) as e:
            raise OpenAIError(400, str(e), param="lora_path") from None
        request = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        self.adapters[name] = request
        return request

    def unload(self, name: str) -> None:
        if self.adapters.pop(name, None) is None:
            raise OpenAIError(404, f"the adapter {name!r} is not loaded", param="lora_name",
                              code="model_not_found")


def lora_body(body: Any, *fields: str) -> list[str]:
    """The string fields of a load/unload body (400 naming the first missing)."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the body must be a JSON object")
    out = []
    for name in fields:
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise OpenAIError(400, f"{name} must be a non-empty string", param=name)
        out.append(value)
    return out
