"""Executor failures the engine loop treats as the end of the engine (no torch)."""

from __future__ import annotations


class ExecutorDeadError(RuntimeError):
    """The executor can run no more steps: a tensor-parallel rank died, hung past the
    distributed timeout, or failed (its shard's state is lost, and with it the step every
    rank must run together). The engine loop fails every open request with this message
    and stops, so that ``/health`` answers 503."""
