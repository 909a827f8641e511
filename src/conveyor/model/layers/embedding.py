"""The token embedding, its vocabulary split across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.distributed.parallel import SINGLE, TPShard


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + shard)`` of the vocabulary (zero rows past its end); a token
    outside them embeds to zeros here and the all-reduce brings its row from its rank."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPShard = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        shard = tp.vocab_shard(vocab_size)
        self.start = tp.rank * shard
        self.weight = nn.Parameter(torch.empty(shard, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0.0))
