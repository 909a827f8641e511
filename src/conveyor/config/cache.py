"""The paged KV pool: its block size and how many blocks it gets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from conveyor.config.model import ModelConfig


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory
    kv_cache_memory: int | None = None  # bytes; None: a share of free memory
    enable_prefix_caching: bool = True
    # CUDA: the share of the device's memory the engine may use (weights, a full step's
    # activations as profiled, and the KV pool: the rest), as vLLM's flag.
    gpu_memory_utilization: float = 0.9
    # A model windowed on every layer: blocks behind every future position's window go
    # back to the pool (config/kv_window.py); False keeps whole contexts (a benchmark's
    # baseline).
    free_outside_window: bool = True
    # A hybrid model (windowed and global layers): a block table per layer group, the
    # windowed group's freed behind the window (config/kv_window.py: kv_groups); False
    # keeps whole contexts in every layer (--disable-hybrid-kv-cache-manager).
    hybrid_kv_groups: bool = True



def gpu_kv_cache_bytes(total: int, utilization: float, peak_torch: int,
                       non_torch: int) -> int:
    """What a CUDA device leaves the KV pool (vLLM's rule): ``utilization`` of its memory,
    less the peak torch allocated through a full dummy step (weights and activations)
    and what others hold outside torch's allocator (the CUDA context, NCCL buffers)."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    left = int(total * utilization) - peak_torch - non_torch
    if left <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} gives the engine "
            f"{total * utilization / 2**30:.2f} GiB of {total / 2**30:.2f} GiB, but the "
            f"weights and a full step's activations peaked at {peak_torch / 2**30:.2f} GiB "
            f"(plus {non_torch / 2**30:.2f} GiB outside torch): no room for a KV cache; "
            "raise it, or lower --max-num-batched-tokens")
    return left


def kv_blocks_for(cache: CacheConfig, model: ModelConfig, max_num_seqs: int, *,
                  default_memory: Callable[[], int], cap_to_useful: bool) -> int:
    """KV blocks from ``num_kv_blocks``, else ``kv_cache_memory``, else ``default_memory()``.

    Torch-free so that the runner and the simulator size the pool by the same rule;
    ``cap_to_useful`` caps the default at what ``max_num_seqs`` full-length sequences use.
    """
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    bytes_per_block = model.kv_bytes_per_token * cache.block_size
    if cache.kv_cache_memory is not None:
        blocks = cache.kv_cache_memory // bytes_per_block
    else:
        blocks = default_memory() // bytes_per_block
        if cap_to_useful:
            useful = max_num_seqs * -(-model.max_model_len // cache.block_size)
            blocks = min(blocks, useful)
    if blocks < 1:
        raise ValueError(f"kv_cache_memory holds no block of {cache.block_size} tokens "
                         "for this model")
    return int(blocks)

