"""Prefill/decode disaggregation: a KV connector in two halves (docs/disaggregation.md).

- ``state``: the per-transfer state machine and its lease (time passed in, no clock).
- ``messages``: the typed handle a request carries, the connector's per-step metadata,
  the worker's per-step report, and the wire headers.
- ``connector``: the scheduler-side half (no torch): which requests load or save KV,
  leases on the blocks held for a peer, the fallback when a transfer fails.
- ``worker``: the executor-side half (torch): reads and writes the paged KV tensors by
  block id, serves pulls, runs loads on background threads.
- ``transport``: pyzmq over TCP (loopback on one host); bytes counted.
"""
