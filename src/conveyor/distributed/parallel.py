"""Which part of the model a tensor-parallel rank holds, and the model's collectives.

Megatron-style: Q/K/V and gate/up are column-parallel (a rank holds some heads and some
intermediate rows), o_proj and down_proj row-parallel (their input columns; one
all-reduce after each), the embedding and LM head vocabulary-parallel (a slice of the
vocabulary; the embedding masks and all-reduces, the LM head all-gathers). With
``world_size == 1`` every method is the identity and no collective runs, so the
single-process model is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class HeadSplit:
    """A rank's attention heads: ``num_heads`` query heads from ``q_start`` and
    ``num_kv_heads`` KV heads from ``kv_start`` (global head indices)."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int


def split_heads(num_heads: int, num_kv_heads: int, world_size: int, rank: int) -> HeadSplit:
    """Query heads split evenly; KV heads too, or, with more ranks than KV heads, each
    rank holds the one KV head its query heads read (replicated ``world / kv`` times).
    Both ways rank r's query heads map (GQA: head h reads kv head h // (H / kv)) onto
    exactly the KV heads it holds."""
    if num_heads % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} must divide the "
                         f"{num_heads} attention heads")
    q_local = num_heads // world_size
    if world_size <= num_kv_heads:
        if num_kv_heads % world_size:
            raise ValueError(f"tensor_parallel_size {world_size} must divide the "
                             f"{num_kv_heads} KV heads")
        kv_local = num_kv_heads // world_size
        return HeadSplit(q_local, kv_local, rank * q_local, rank * kv_local)
    if world_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {world_size} must be a multiple of the "
                         f"{num_kv_heads} KV heads to replicate them")
    return HeadSplit(q_local, 1, rank * q_local, rank // (world_size // num_kv_heads))


@dataclass(frozen=True)
class TPShard:
    """This rank's place in the tensor-parallel group; ``group`` is the
    ``torch.distributed`` process group (None on one rank)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadSplit:
        return split_heads(num_heads, num_kv_heads, self.world_size, self.rank)

    def intermediate(self, size: int) -> int:
        if size % self.world_size:
            raise ValueError(f"tensor_parallel_size {self.world_size} must divide the "
                             f"intermediate size {size}")
        return size // self.world_size

    def vocab_shard(self, vocab_size: int) -> int:
        """Rows per rank of the embedding and LM head: the vocabulary split in equal
        shards (the last padded with zero rows), so that the all-gather is of equal
        pieces."""
        return -(-vocab_size // self.world_size)

    # ---- collectives ---------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the ranks' partial results (after a row-parallel projection). Every rank
        ends with the same bits (for two ranks a + b == b + a exactly; gloo's ring gives
        each chunk one reduction order and broadcasts it)."""
        if self.enabled:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[T, vocab_shard] per rank -> [T, vocab_size] on every rank, identical bits."""
        if not self.enabled:
            return local
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., :vocab_size]


SINGLE = TPShard()
