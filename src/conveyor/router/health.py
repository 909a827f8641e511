"""Each replica's state as the router sees it, and the checker that keeps it current.

A replica is in rotation while its last health check passed and no connection to it has
failed since: a failed connect takes it out at once (the request tries another), the
checker (``GET /health`` every ``interval_s``) puts it back when it answers 200 again.
With prefix routing the checker also reads ``GET /v1/kv_summary`` (the hashes of the
blocks the replica caches, and its load).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from conveyor.router.policies import CacheIndex, RoutingRequest, uncached_tokens

logger = logging.getLogger("conveyor.router")


@dataclass(eq=False)
class Replica:
    url: str
    healthy: bool = False
    reason: str = "not checked yet"  # why it is out of rotation
    # The router's own tally (exact and immediate): requests in flight, and the prompt
    # tokens they brought that the replica had not cached (the KV they add) ...
    in_flight: int = 0
    in_flight_tokens: int = 0
    # ... and what the replica reported at its last summary (traffic from elsewhere too).
    reported_unfinished: int = 0
    reported_kv_tokens: int = 0
    block_size: int | None = None
    hash_key: bytes = b""
    num_routed: int = 0
    num_failed: int = 0
    cache: CacheIndex = field(default_factory=lambda: CacheIndex(time.monotonic))
    # The model names it serves (its /v1/models: the base model and loaded adapters).
    models: frozenset[str] = frozenset()
    # Its adapters' ids (its last summary's ``lora_ids``): an adapter's block chain starts
    # from the replica's own id for it, as its prefix cache keys them (lora_hash_key).
    lora_ids: dict[str, int] = field(default_factory=dict)

    # ---- ReplicaView ---------------------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return max(self.in_flight, self.reported_unfinished)

    @property
    def num_active_tokens(self) -> int:
        return max(self.in_flight_tokens, self.reported_kv_tokens)

    def num_cached_tokens(self, request: RoutingRequest) -> int:
        if self.block_size is None:
            return 0  # no summary yet: nothing known to be cached
        hashes = request.block_hashes(self.block_size, self.hash_key, self.lora_id(request))
        return self.cache.num_cached_blocks(hashes) * self.block_size

    def lora_id(self, request: RoutingRequest) -> int:
        """This replica's id of the adapter ``request`` names (0: the base model)."""
        return self.lora_ids.get(request.model or "", 0)

    # ---- the router's bookkeeping --------------------------------------------------------
    def begin(self, request: RoutingRequest) -> int:
        """Count a request sent here; returns the tokens charged, for ``end``."""
        charged = uncached_tokens(request, self)
        self.in_flight += 1
        self.in_flight_tokens += charged
        self.num_routed += 1
        if self.block_size is not None:
            self.cache.add_routed(request.block_hashes(self.block_size, self.hash_key,
                                                       self.lora_id(request)))
        return charged

    def end(self, charged: int) -> None:
        self.in_flight -= 1
        self.in_flight_tokens -= charged

    def mark_down(self, reason: str) -> None:
        if self.healthy:
            logger.error("replica %s taken out of rotation: %s", self.url, reason)
        self.healthy = False
        self.reason = reason
        # A replica that comes back may be a fresh process: its old cache is gone.
        self.cache.clear()
        self.reported_unfinished = self.reported_kv_tokens = 0

    def mark_up(self) -> None:
        if not self.healthy:
            logger.warning("replica %s in rotation", self.url)
        self.healthy = True
        self.reason = ""

    def apply_summary(self, summary: dict) -> None:
        """Fold in a ``/v1/kv_summary`` body; a malformed one is a ValueError."""
        try:
            block_size = int(summary["block_size"])
            hash_key = bytes.fromhex(summary["hash_key"])
            hashes = [bytes.fromhex(h) for h in summary["block_hashes"]]
            unfinished = int(summary["num_running"]) + int(summary["num_waiting"])
            kv_tokens = int(summary["kv_blocks_in_use"]) * block_size
            hash_bytes = int(summary["hash_bytes"])
            lora_ids = {str(k): int(v) for k, v in summary.get("lora_ids", {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"malformed /v1/kv_summary from {self.url}: {e!r}") from None
        self.block_size, self.hash_key, self.lora_ids = block_size, hash_key, lora_ids
        self.cache.hash_bytes = hash_bytes
        self.cache.replace_summary(hashes)
        self.reported_unfinished, self.reported_kv_tokens = unfinished, kv_tokens

    def state(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "reason": self.reason,
                "in_flight": self.in_flight, "routed": self.num_routed,
                "failed": self.num_failed, "summary_blocks": len(self.cache.summary)}


class HealthChecker:
    """Checks every replica each ``interval_s`` (concurrently, ``timeout_s`` each)."""

    def __init__(self, replicas: Sequence[Replica], client: httpx.AsyncClient, *,
                 interval_s: float = 1.0, timeout_s: float = 5.0, summaries: bool = False,
                 summary_blocks: int = 8192) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError(f"health interval and timeout must be > 0, got {interval_s}, "
                             f"{timeout_s}")
        self.replicas = replicas
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.summaries = summaries
        self.summary_blocks = summary_blocks

    async def check(self, replica: Replica) -> None:
        try:
            r = await self.client.get(replica.url + "/health", timeout=self.timeout_s)
        except httpx.HTTPError as e:
            replica.mark_down(f"health check failed: {type(e).__name__}: {e}")
            return
        except Exception as e:
            # Anything else (a bug, a transport's odd failure) fails this check only:
            # raised out of check_all, it would end the checker's task, and no replica
            # would ever come back into rotation.
            logger.exception("health check of %s raised", replica.url)
            replica.mark_down(f"health check raised {type(e).__name__}: {e}")
            return
        if r.status_code != 200:
            replica.mark_down(f"/health answered {r.status_code}")
            return
        replica.mark_up()
        await self.read_models(replica)
        if self.summaries:
            await self.read_summary(replica)

    async def read_models(self, replica: Replica) -> None:
        """The names the replica serves (adapter affinity); a failed read keeps the last."""
        try:
            r = await self.client.get(replica.url + "/v1/models", timeout=self.timeout_s)
            r.raise_for_status()
            replica.models = frozenset(str(card["id"]) for card in r.json()["data"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            logger.warning("no model list from %s: %s: %s", replica.url, type(e).__name__, e)

    async def read_summary(self, replica: Replica) -> None:
        """A summary waits for the replica's current step (it is read between steps): one
        that fails or is late keeps the last one and leaves the replica in rotation."""
        try:
            s = await self.client.get(replica.url + "/v1/kv_summary",
                                      params={"max_blocks": self.summary_blocks},
                                      timeout=self.timeout_s)
            s.raise_for_status()
            replica.apply_summary(s.json())
        except (httpx.HTTPError, ValueError) as e:
            logger.warning("no KV summary from %s: %s: %s", replica.url, type(e).__name__, e)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in self.replicas))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.check_all()
