"""Data-parallel routing policies: which replica takes a new request. No HTTP here: the
router app (``app.py``) and the simulator (``sim/router.py``) both call these.

- ``round-robin``: replicas in turn, whatever their load.
- ``least-loaded``: the fewest unfinished requests (running plus waiting); ties go to the
  fewest prompt tokens in flight, then the lowest index.
- ``prefix``: the lowest cost, where a replica's cost is the prompt tokens it would have
  to prefill (the prompt less the longest run of its leading blocks that replica holds,
  keyed by the engine's own chained block hashes over the whole prompt) plus its KV load
  in tokens once it has taken the request (what it holds for its unfinished requests,
  plus those uncached tokens): NVIDIA Dynamo's KV router cost (prefill blocks plus
  active blocks, overlap weight 1). A replica that is overloaded (more than
  ``balance_abs`` unfinished requests above the least loaded, and more than
  ``balance_rel`` times as many: SGLang's thresholds) is not a candidate, so traffic
  spills to the others.

A policy sees only what a ``ReplicaView`` offers; the caller passes the replicas that are
in rotation, and gets back an index into that sequence.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from conveyor.core.kv_cache_manager import prompt_block_hashes


class ReplicaView(Protocol):
    @property
    def num_unfinished(self) -> int:
        """Running plus waiting requests."""
        ...

    @property
    def num_active_tokens(self) -> int:
        """KV tokens the replica holds or will hold for its unfinished requests (a prefix
        they share counted once)."""
        ...

    def num_cached_tokens(self, request: RoutingRequest) -> int:
        """Leading prompt tokens of ``request`` whose K/V the replica holds (or will, once
        the requests routed to it are prefilled)."""
        ...


@dataclass
class RoutingRequest:
    """What a policy knows of a request: its prompt's token ids (None when the router
    could not learn them: then only its load counts) or at least their number."""

    prompt_token_ids: list[int] | None
    num_prompt_tokens: int = 0
    model: str | None = None  # the body's model: the base model's name or an adapter's
    _hashes: dict[tuple[int, bytes, int], list[bytes]] = field(default_factory=dict,
                                                              repr=False)

    def __post_init__(self) -> None:
        if self.prompt_token_ids is not None:
            self.num_prompt_tokens = len(self.prompt_token_ids)

    def block_hashes(self, block_size: int, hash_key: bytes, lora_id: int = 0) -> list[bytes]:
        """The engine's chained hashes of the prompt's full blocks under a replica's block
        size, salt and id of the adapter (0: the base model), computed once per those."""
        if self.prompt_token_ids is None:
            return []
        key = (block_size, hash_key, lora_id)
        if key not in self._hashes:
            self._hashes[key] = prompt_block_hashes(self.prompt_token_ids, block_size,
                                                    hash_key, lora_id)
        return self._hashes[key]


class Policy(Protocol):
    name: str
    needs_hashes: bool

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaView]) -> int: ...


def least_loaded(replicas: Sequence[ReplicaView]) -> int:
    if not replicas:
        raise ValueError("no replica to route to")
    return min(range(len(replicas)),
               key=lambda i: (replicas[i].num_unfinished, replicas[i].num_active_tokens, i))


class RoundRobin:
    name = "round-robin"
    needs_hashes = False

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaView]) -> int:
        if not replicas:
            raise ValueError("no replica to route to")
        return next(self._counter) % len(replicas)


class LeastLoaded:
    name = "least-loaded"
    needs_hashes = False

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaView]) -> int:
        return least_loaded(replicas)


@dataclass
class PrefixAware:
    """``prefix``: uncached prefill tokens plus load, with overloaded replicas left out."""

    balance_abs: int = 8
    balance_rel: float = 1.5
    # A token of KV load against a token to prefill (Dynamo's overlap weight, inverted).
    load_weight: float = 1.0
    name: str = "prefix"
    needs_hashes: bool = True

    def __post_init__(self) -> None:
        if self.balance_abs < 0 or self.balance_rel < 1.0 or self.load_weight < 0:
            raise ValueError(f"prefix routing needs balance_abs >= 0, balance_rel >= 1 and "
                             f"load_weight >= 0, got {self.balance_abs}, {self.balance_rel}, "
                             f"{self.load_weight}")

    def overloaded(self, load: int, lowest: int) -> bool:
        return load - lowest > self.balance_abs and load > self.balance_rel * lowest

    def cost(self, request: RoutingRequest, replica: ReplicaView) -> float:
        uncached = uncached_tokens(request, replica)
        return uncached + self.load_weight * (replica.num_active_tokens + uncached)

    def choose(self, request: RoutingRequest, replicas: Sequence[ReplicaView]) -> int:
        if not replicas:
            raise ValueError("no replica to route to")
        lowest = min(r.num_unfinished for r in replicas)
        candidates = [i for i, r in enumerate(replicas)
                      if not self.overloaded(r.num_unfinished, lowest)]
        return min(candidates, key=lambda i: (self.cost(request, replicas[i]),
                                              replicas[i].num_unfinished, i))


POLICIES: dict[str, Callable[[], Policy]] = {
    "prefix": PrefixAware,
    "least-loaded": LeastLoaded,
    "round-robin": RoundRobin,
}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; valid: "
                         f"{', '.join(sorted(POLICIES))}") from None


def serving_model(replicas: Sequence, model: str | None) -> list:
    """Adapter affinity: the replicas that list ``model`` (their ``models``, from each
    one's /v1/models) if any does, else all (the one chosen answers a 404 itself). So an
    adapter's requests go to the replicas that have it loaded, and the policy chooses
    among those."""
    if model is None:
        return list(replicas)
    having = [r for r in replicas if model in getattr(r, "models", ())]
    return having or list(replicas)


def uncached_tokens(request: RoutingRequest, replica: ReplicaView) -> int:
    """The prompt tokens ``replica`` would have to prefill for ``request``."""
    return max(request.num_prompt_tokens - replica.num_cached_tokens(request), 0)


def leading_run(block_hashes: Sequence[bytes], held: Callable[[bytes], bool]) -> int:
    """How many leading hashes of the chain ``held`` accepts (a chain breaks at its first
    miss: a later block's K/V depends on every block before it)."""
    n = 0
    for h in block_hashes:
        if not held(h):
            break
        n += 1
    return n


class CacheIndex:
    """A replica's prefix cache as a router knows it: the hashes of its last summary (cut to
    ``hash_bytes``), plus the blocks of prompts routed to it since, which it will hold once
    it has prefilled them; those expire after ``recent_ttl_s`` (a summary taken after
    that shows whether they stayed cached)."""

    def __init__(self, clock: Callable[[], float], hash_bytes: int = 8,
                 recent_ttl_s: float = 30.0, max_recent: int = 1 << 16) -> None:
        self.clock = clock
        self.hash_bytes = hash_bytes
        self.recent_ttl_s = recent_ttl_s
        self.max_recent = max_recent
        self.summary: frozenset[bytes] = frozenset()
        self._recent: OrderedDict[bytes, float] = OrderedDict()  # hash -> expiry

    def replace_summary(self, hashes: Iterable[bytes]) -> None:
        self.summary = frozenset(h[:self.hash_bytes] for h in hashes)
        now = self.clock()
        while self._recent and next(iter(self._recent.values())) <= now:
            self._recent.popitem(last=False)

    def add_routed(self, block_hashes: Sequence[bytes]) -> None:
        expiry = self.clock() + self.recent_ttl_s
        for h in block_hashes:
            key = h[:self.hash_bytes]
            self._recent[key] = expiry
            self._recent.move_to_end(key)
        while len(self._recent) > self.max_recent:
            self._recent.popitem(last=False)

    def clear(self) -> None:
        """The replica restarted or left: whatever it held is gone."""
        self.summary = frozenset()
        self._recent.clear()

    def held(self, block_hash: bytes) -> bool:
        key = block_hash[:self.hash_bytes]
        return key in self.summary or self._recent.get(key, -1.0) > self.clock()

    def num_cached_blocks(self, block_hashes: Sequence[bytes]) -> int:
        return leading_run(block_hashes, self.held)
