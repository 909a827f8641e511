"""Structured outputs: a constrained request waits for its grammar outside the batch.

A request with ``structured_outputs`` whose grammar is not compiled yet enters
``WAITING_FOR_GRAMMAR`` instead of the waiting queue: it is not scheduled, holds no blocks
and no batch slot, and no step waits for its compile (vLLM V1's ``WAITING_FOR_FSM``). The
compile itself is the executor's (the runner owns the matchers, ``runner/grammar.py``):
the gate orders it by constraint key through ``SchedulerOutput.grammar_compiles`` and
learns the outcome as data in ``ModelRunnerOutput.grammars_ready`` / ``grammar_errors``,
so the scheduler runs no compile and reads no clock. When a key is ready every request
held on it joins the waiting queue (the policy orders it by its arrival as usual); a
failed compile finishes those requests alone, aborted with ``stop_reason``
``"grammar_compile_failed: <why>"``.

The gate also decides what the runner's cache of compiled grammars keeps: a request
whose key is compiled is admitted at once (no step of delay), so the runner must still
hold that key when the request reaches it. The runner drops a key only when the gate
says so (``grammar_evictions``), and the gate evicts only keys no live request uses,
least recently used first, beyond ``capacity``.

Why not prefill while the grammar compiles (and hold back only the sampling): a request
would then hold blocks and a batch slot for as long as a slow compile takes, and the
prefill split would need a running request that may get no tokens.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from conveyor.request import Request, RequestStatus
from conveyor.structured_outputs import StructuredOutputsParams

# stop_reason prefix of a request whose grammar failed to compile (the server: HTTP 400).
GRAMMAR_FAILED = "grammar_compile_failed"
WAITING_FOR_GRAMMAR = RequestStatus.WAITING_FOR_GRAMMAR
# Compiled grammars kept beyond those in use: schemas repeat across requests.
CACHE_SIZE = 256


class GrammarGate:
    def __init__(self, capacity: int = CACHE_SIZE) -> None:
        self.capacity = capacity
        self.held: dict[str, Request] = {}  # request id -> request, its key compiling
        self._key_of: dict[str, str] = {}  # live constrained request id -> its key
        self._users: Counter[str] = Counter()  # key -> live requests
        self._ready: OrderedDict[str, None] = OrderedDict()  # compiled keys, LRU first
        self._compiling: dict[str, list[str]] = {}  # key -> request ids held on it
        self._orders: dict[str, StructuredOutputsParams] = {}  # not yet sent
        self._evictions: list[str] = []  # not yet sent

    def __len__(self) -> int:
        return len(self.held)

    def hold(self, request: Request) -> bool:
        """A new request: True if it must wait for its grammar (its compile ordered, or
        already under way); False if it carries none or its grammar is compiled."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return False
        rid, key = request.request_id, params.key()
        self._key_of[rid] = key
        self._users[key] += 1
        if key in self._ready:
            self._ready.move_to_end(key)
            return False
        request.status = WAITING_FOR_GRAMMAR
        self.held[rid] = request
        if key not in self._compiling:
            self._compiling[key] = []
            self._orders[key] = params
        self._compiling[key].append(rid)
        return True

    def finished(self, request_id: str) -> None:
        """A request left for good (finished, aborted, failed): its key is used less."""
        self.held.pop(request_id, None)
        key = self._key_of.pop(request_id, None)
        if key is not None:
            self._users[key] -= 1
            if not self._users[key]:
                del self._users[key]

    def take_orders(self) -> tuple[dict[str, StructuredOutputsParams], list[str]]:
        """(key -> constraint to compile, keys the runner drops) for this step; the runner
        applies the drops first (a key may be dropped and ordered again in one step)."""
        orders, self._orders = self._orders, {}
        evictions, self._evictions = self._evictions, []
        return orders, evictions

    def settle(self, ready: list[str], errors: dict[str, str]
               ) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Keys whose compile ended, from a step's report: (the requests now free to run,
        (failed request, why) pairs). Requests aborted since are gone already."""
        released: list[Request] = []
        failed: list[tuple[Request, str]] = []
        for key in ready:
            self._ready[key] = None
            released += self._release(key)
        for key, error in errors.items():
            failed += [(r, error) for r in self._release(key)]
            self._evictions.append(key)  # the runner forgets the failure
        while len(self._ready) > self.capacity:
            idle = next((k for k in self._ready if k not in self._users), None)
            if idle is None:
                break  # every kept grammar is in use: the cache grows with the requests
            del self._ready[idle]
            self._evictions.append(idle)
        return released, failed

    def _release(self, key: str) -> list[Request]:
        return [r for rid in self._compiling.pop(key, [])
                if (r := self.held.pop(rid, None)) is not None]
