"""Which sliding window bounds the KV a request must keep (no torch): blocks wholly before
the window of every attention layer, for every position still to be computed, are never
read again and go back to the pool (``core/kv_cache_manager.py``).

The layers' windows follow the family's rule (``model/models/decoder.py: layer_windows``,
which a test holds this module to): config.json's ``sliding_window`` where windows are on
(``use_sliding_window``, else the family's default), on the layers ``layer_types`` marks.
Only a model whose every layer is windowed frees anything: one global layer (Gemma 2's
and 3's pattern) reads the whole context, and a pool shared by both kinds would need a
block table per layer group.
"""

from __future__ import annotations

from conveyor.config.engine import EngineConfig
from conveyor.config.model import ModelConfig

# Families whose window is on unless config.json's use_sliding_window turns it off.
WINDOW_ON_BY_DEFAULT = frozenset({"MistralForCausalLM", "MixtralForCausalLM",
                                  "Phi3ForCausalLM", "Gemma2ForCausalLM",
                                  "Gemma3ForCausalLM"})


def gemma2_layer_types(hf: dict, num_layers: int) -> list[str]:
    """Gemma 2's layers where config.json lists none: windowed on the even ones."""
    return hf.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def gemma3_layer_types(hf: dict, num_layers: int) -> list[str]:
    """Gemma 3's layers where config.json lists none: ``sliding_window_pattern`` - 1
    windowed ones, then a global one."""
    pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6)
    return hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(num_layers)]


# A family's own pattern where config.json lists no ``layer_types`` (the model's
# ``layer_types`` hook calls the same function).
_LAYER_TYPES = {"Gemma2ForCausalLM": gemma2_layer_types,
                "Gemma3ForCausalLM": gemma3_layer_types}


def model_kv_window(model: ModelConfig) -> int | None:
    """The window every layer of ``model`` attends within, or None (a layer attends to the
    whole context, or windows are off)."""
    hf = model.hf_config
    window = hf.get("sliding_window")
    on_by_default = model.architecture in WINDOW_ON_BY_DEFAULT
    if not window or not hf.get("use_sliding_window", on_by_default):
        return None
    pattern = _LAYER_TYPES.get(model.architecture)
    types = pattern(hf, model.num_layers) if pattern else hf.get("layer_types")
    if types and any(t != "sliding_attention" for t in types[:model.num_layers]):
        return None
    return int(window)


def kv_free_window(config: EngineConfig) -> int | None:
    """The window the KV cache manager frees blocks behind, or None to keep whole contexts:
    also None where something else reads a request's blocks beyond the target model's
    window (a draft model writes and reads the same blocks with its own layers; a KV
    transfer hands the whole table to another engine), or where the cache config says so."""
    if not config.cache.free_outside_window or config.kv_transfer.enabled:
        return None
    speculative = config.scheduler.speculative
    if speculative is not None and speculative.writes_draft_kv:
        return None
    return model_kv_window(config.model)
