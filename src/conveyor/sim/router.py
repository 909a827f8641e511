"""Routers: which replica a new request goes to. Registered by name.

- ``round_robin``: replicas in turn, whatever their load.
- ``least_loaded``: the replica with the fewest unfinished requests (running plus
  waiting); ties go to the lowest index.
- ``prefix_affinity``: the replica that last received the longest prefix of this
  prompt (in chunks of ``chunk_tokens``), so that its prefix cache can serve it,
  unless the replicas are out of balance (the most loaded has more than
  ``balance_abs`` requests more than the least loaded, and more than
  ``balance_rel`` times as many), or no replica has seen the prefix: then
  ``least_loaded``. This is the cache-aware routing of SGLang's router, with a hash
  chain standing in for its radix tree.
- ``prefix``: ``conveyor router --routing prefix``'s own policy
  (``conveyor.router.policies.PrefixAware``): uncached prefill tokens (by the engine's
  chained block hashes over the whole prompt) plus load in tokens, overloaded replicas
  left out. What a replica holds is read from its pool directly (the real router reads a
  summary each second), plus, as the real router does, the prompts routed to it that it
  has not cached yet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from conveyor.router.policies import (
    CacheIndex,
    PrefixAware,
    RoutingRequest,
    leading_run,
    uncached_tokens,
)

if TYPE_CHECKING:
    from conveyor.sim.replica import SimReplica


class LoadView(Protocol):
    @property
    def num_unfinished(self) -> int: ...


class Router(Protocol):
    name: str

    def route(self, prompt_token_ids: list[int], replicas: Sequence[LoadView],
              request_id: str = "", lora: str | None = None) -> int:
        """Index of the replica that takes the request with this prompt (and adapter:
        ``lora``, its name; None: the base model)."""
        ...


class RoundRobinRouter:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, prompt_token_ids: list[int], replicas: Sequence[LoadView],
              request_id: str = "", lora: str | None = None) -> int:
        i = self._next % len(replicas)
        self._next += 1
        return i


def least_loaded(replicas: Sequence[LoadView]) -> int:
    best, best_load = 0, replicas[0].num_unfinished
    for i in range(1, len(replicas)):
        load = replicas[i].num_unfinished
        if load < best_load:
            best, best_load = i, load
    return best


class LeastLoadedRouter:
    name = "least_loaded"

    def route(self, prompt_token_ids: list[int], replicas: Sequence[LoadView],
              request_id: str = "", lora: str | None = None) -> int:
        return least_loaded(replicas)


class PrefixAffinityRouter:
    name = "prefix_affinity"

    def __init__(self, chunk_tokens: int = 64, balance_abs: int = 8,
                 balance_rel: float = 1.5) -> None:
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.chunk_tokens = chunk_tokens
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        # chained hash of a prompt prefix (whole chunks) -> replica that last received it
        self._owner: dict[int, int] = {}

    def _chain(self, tokens: list[int], lora: str | None = None) -> list[int]:
        n = self.chunk_tokens
        hashes, h = [], hash(lora) if lora else 0  # an adapter's prefixes are its own
        for i in range(0, len(tokens) - n + 1, n):
            h = hash((h, tuple(tokens[i:i + n])))
            hashes.append(h)
        return hashes

    def route(self, prompt_token_ids: list[int], replicas: Sequence[LoadView],
              request_id: str = "", lora: str | None = None) -> int:
        chain = self._chain(prompt_token_ids, lora)
        loads = [r.num_unfinished for r in replicas]
        lo, hi = min(loads), max(loads)
        balanced = hi - lo <= self.balance_abs or hi <= self.balance_rel * lo
        choice = None
        if balanced:
            for h in reversed(chain):  # the longest prefix some replica has seen
                choice = self._owner.get(h)
                if choice is not None and choice < len(replicas):
                    break
                choice = None
        if choice is None:
            choice = least_loaded(replicas)
        for h in chain:
            self._owner[h] = choice
        return choice


class _SimReplicaView:
    """A simulated replica as ``PrefixAware`` sees it. Its load in tokens is what the real
    router counts (the uncached prompt tokens of its unfinished requests, as estimated
    when each was routed), or its pool's blocks in use if more."""

    def __init__(self, replica: SimReplica, routed: CacheIndex,
                 charged: dict[str, int]) -> None:
        self.replica = replica
        self.routed = routed
        self.charged = charged

    @property
    def num_unfinished(self) -> int:
        return self.replica.num_unfinished

    @property
    def num_active_tokens(self) -> int:
        rep, charged = self.replica, self.charged
        tally = (sum(charged.get(rid, 0) for rid in rep.scheduler.requests)
                 + sum(charged.get(w.request_id, 0) for w in rep.inbox))
        return max(tally, rep.kv.pool.num_used_blocks * rep.kv.block_size)

    def num_cached_tokens(self, request: RoutingRequest) -> int:
        kv = self.replica.kv
        if not kv.enable_prefix_caching:
            return 0
        hashes = request.block_hashes(kv.block_size, kv.hash_key, self.lora_id(request))
        pool, routed = kv.pool, self.routed
        n = leading_run(hashes, lambda h: pool.lookup(h) is not None or routed.held(h))
        return n * kv.block_size

    def lora_id(self, request: RoutingRequest) -> int:
        """The replica's id of the adapter the request names (its prefix cache's key)."""
        lora = self.replica.lora_request(request.model)
        return lora.lora_int_id if lora is not None else 0


class PrefixRouter:
    name = "prefix"

    def __init__(self) -> None:
        self.policy = PrefixAware()
        self._views: list[_SimReplicaView] = []
        self._charged: dict[str, int] = {}  # request id -> uncached tokens when routed

    def route(self, prompt_token_ids: list[int], replicas: Sequence[LoadView],
              request_id: str = "", lora: str | None = None) -> int:
        if len(self._views) != len(replicas):
            reps: Sequence[SimReplica] = replicas  # type: ignore[assignment]

            def now() -> float:  # the latest time any replica has seen (an idle one's
                return max(r.clock.now for r in reps)  # clock stands still)
            self._views = [_SimReplicaView(r, CacheIndex(now), self._charged) for r in reps]
        request = RoutingRequest(prompt_token_ids, model=lora)
        i = self.policy.choose(request, self._views)
        view = self._views[i]
        self._charged[request_id] = uncached_tokens(request, view)
        kv = view.replica.kv
        view.routed.add_routed(request.block_hashes(kv.block_size, kv.hash_key,
                                                    view.lora_id(request)))
        return i


ROUTERS: dict[str, Callable[[], Router]] = {
    "round_robin": RoundRobinRouter,
    "least_loaded": LeastLoadedRouter,
    "prefix_affinity": PrefixAffinityRouter,
    "prefix": PrefixRouter,
}


def make_router(name: str) -> Router:
    try:
        return ROUTERS[name]()
    except KeyError:
        raise ValueError(f"unknown router {name!r}; valid routers: "
                         f"{', '.join(sorted(ROUTERS))}") from None
