"""Prefill/decode disaggregation: this engine's role and its KV transfer's limits."""

from __future__ import annotations

from dataclasses import dataclass

KV_ROLES = ("both", "prefill", "decode")
KV_FALLBACKS = ("recompute", "fail")


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation (docs/disaggregation.md). ``both``: today's engine,
    no connector. ``prefill`` serves its requests' K/V on ``host:port``; ``decode`` pulls
    K/V for requests that carry a prefill's handle."""

    role: str = "both"
    host: str = "127.0.0.1"
    port: int | None = None
    # Blocks held for a peer are released this long after the request finished, pulled
    # or not (prefill side).
    lease_timeout_s: float = 30.0
    # A load that has not landed this long after it was ordered fails (decode side).
    transfer_timeout_s: float = 10.0
    # What a failed load does: compute the prompt here, or fail that request.
    fallback: str = "recompute"

    def __post_init__(self) -> None:
        if self.role not in KV_ROLES:
            raise ValueError(f"kv role must be one of {KV_ROLES}, got {self.role!r}")
        if self.fallback not in KV_FALLBACKS:
            raise ValueError(f"kv transfer fallback must be one of {KV_FALLBACKS}, "
                             f"got {self.fallback!r}")
        if self.role == "prefill" and self.port is None:
            raise ValueError("--kv-role prefill needs --kv-port (where decode engines pull)")
        if self.lease_timeout_s <= 0 or self.transfer_timeout_s <= 0:
            raise ValueError("kv lease and transfer timeouts must be > 0")

    @property
    def enabled(self) -> bool:
        return self.role != "both"

