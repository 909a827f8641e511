"""Which sliding window bounds the KV a request must keep (no torch): blocks wholly before
the window of every attention layer, for every position still to be computed, are never
read again and go back to the pool (``core/kv_cache_manager.py``).

The layers' windows follow the family's rule (``model/models/decoder.py: layer_windows``,
which a test holds this module to): config.json's ``sliding_window`` where windows are on
(``use_sliding_window``, else the family's default), on the layers ``layer_types`` marks.
A model whose every layer is windowed frees behind that window in its one block table
(``kv_free_window``). A hybrid one (Gemma 2's and 3's global and local layers) gets a
block table per layer group instead (``kv_groups``): the global layers' KV in one pool,
whole contexts; the windowed layers' in a second pool, freed behind the window.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def model_layer_windows(model: ModelConfig) -> list[int | None]:
    """Each layer's sliding window (None: the whole context), by the family's rule."""
    hf = model.hf_config
    window = hf.get("sliding_window")
    on_by_default = model.architecture in WINDOW_ON_BY_DEFAULT
    if not window or not hf.get("use_sliding_window", on_by_default):
        return [None] * model.num_layers
    pattern = _LAYER_TYPES.get(model.architecture)
    types = pattern(hf, model.num_layers) if pattern else hf.get("layer_types")
    if not types:
        return [int(window)] * model.num_layers
    return [int(window) if types[i] == "sliding_attention" else None
            for i in range(model.num_layers)]


def model_kv_window(model: ModelConfig) -> int | None:
    """The window every layer of ``model`` attends within, or None (a layer attends to the
    whole context, or windows are off)."""
    windows = set(model_layer_windows(model))
    return windows.pop() if len(windows) == 1 else None


def _others_read_whole_tables(config: EngineConfig) -> bool:
    """A draft model writes and reads the same blocks with its own layers; a KV transfer
    hands the whole table to another engine."""
    speculative = config.scheduler.speculative
    return config.kv_transfer.enabled or (speculative is not None
                                          and speculative.writes_draft_kv)


def kv_free_window(config: EngineConfig) -> int | None:
    """The window the KV cache manager frees blocks behind, or None to keep whole contexts:
    also None where something else reads a request's blocks beyond the target model's
    window (a draft model writes and reads the same blocks with its own layers; a KV
    transfer hands the whole table to another engine), or where the cache config says so."""
    if not config.cache.free_outside_window or _others_read_whole_tables(config):
        return None
    return model_kv_window(config.model)


@dataclass(frozen=True)
class KVGroups:
    """A hybrid model's KV in two layer groups, each its own pool of blocks and its own
    block table per request: group 0 the full-attention layers (whole contexts), group 1
    the layers windowed by ``window`` (blocks behind it freed).

    The split of memory is fixed (two pools, not vLLM's one pool of ids shared by groups
    of equal layer counts, which Gemma 3's 5:1 pattern would need five groups for): the
    windowed pool gets what ``max_num_seqs`` requests' windows plus one step's tokens can
    hold at once, at most the whole pool's block count; the bytes that saves go to the
    full group's pool. A windowed pool too small only costs preemptions, never
    correctness: a request runs only where both groups get its blocks."""

    window: int
    layer_groups: tuple[int, ...]  # per layer: 0 full attention, 1 windowed
    num_full_blocks: int
    num_window_blocks: int

    @property
    def num_full_layers(self) -> int:
        return self.layer_groups.count(0)

    @property
    def num_window_layers(self) -> int:
        return self.layer_groups.count(1)


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int,
                       max_num_batched_tokens: int) -> int:
    """Blocks the windowed group's requests can hold at once: each keeps the blocks from
    its window's first key to the end of its chunk, at most ``(window - 1 + chunk) /
    block_size + 2``, and the chunks of a step sum to the token budget."""
    per_seq = -(-(window - 1) // block_size) + 2
    return max_num_seqs * per_seq + -(-max_num_batched_tokens // block_size)


def kv_groups_off_reason(config: EngineConfig) -> str | None:
    """Why a hybrid model keeps whole contexts in every layer (None: it need not)."""
    if not config.cache.hybrid_kv_groups or not config.cache.free_outside_window:
        return "turned off (--disable-hybrid-kv-cache-manager)"
    if config.kv_transfer.enabled:
        return "a KV transfer hands whole block tables to another engine"
    if _others_read_whole_tables(config):
        return "a draft model's layers read the same whole block tables"
    if config.device != "cpu":
        return (f"device {config.device}: the GPU backends' page tables and CUDA graphs "
                "read one block table a request")
    return None


def kv_groups(config: EngineConfig) -> KVGroups | None:
    """The layer groups of a hybrid model's KV (windowed and full-attention layers), or
    None to keep whole contexts in one table: not a hybrid model, turned off
    (``--disable-hybrid-kv-cache-manager``), another reader of whole tables (a draft
    model's layers, a KV transfer), or not a CPU engine (the GPU backends' page tables
    and CUDA graphs read one table a request)."""
    windows = model_layer_windows(config.model)
    kinds = set(windows)
    if len(kinds) != 2 or None not in kinds:
        return None  # one kind of layer, or several windows
    if kv_groups_off_reason(config) is not None:
        return None
    window = next(w for w in kinds if w is not None)
    groups = tuple(0 if w is None else 1 for w in windows)
    cache, sched = config.cache, config.scheduler
    total = cache.num_kv_blocks
    assert total is not None, "resolve the KV pool first"
    num_window = min(total, window_pool_blocks(window, cache.block_size, sched.max_num_seqs,
                                               sched.max_num_batched_tokens))
    num_full_layers = groups.count(0)
    num_full = total + (total - num_window) * (len(groups) - num_full_layers) // num_full_layers
    return KVGroups(window, groups, num_full, num_window)
