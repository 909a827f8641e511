"""What a cost model sees of one step: the batch's shape.

Rows follow the runner's split: a row computing one token is a decode (it reads its
whole context from the KV cache), a row computing more is a prefill chunk (causal
attention over the chunk plus the context computed before it). The core reads one off
a ``SchedulerOutput`` (``core/batch_shape.py``).
"""

from __future__ import annotations

from typing import NamedTuple


class BatchShape(NamedTuple):
    """Immutable and hashable; a NamedTuple because one is built every simulated step."""

    num_prefill_tokens: int = 0  # tokens of the rows computing more than one token
    num_prefills: int = 0
    # Query-key pairs of the prefill rows: a chunk of n tokens after s computed ones
    # attends n*s + n(n+1)/2 pairs.
    prefill_attention: int = 0
    # KV tokens the prefill rows read or write (s + n per row).
    prefill_context: int = 0
    num_decodes: int = 0
    decode_context: int = 0  # sum of the decode rows' context lengths (KV tokens read)
    # The longest: conveyor's CPU/torch runner pads every decode row to it.
    max_decode_context: int = 0
    num_sampled: int = 0  # rows that reach their end and sample (LM head rows)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decodes

    @property
    def attention_pairs(self) -> int:
        return self.prefill_attention + self.decode_context

    @property
    def kv_tokens_read(self) -> int:
        return self.prefill_context + self.decode_context
