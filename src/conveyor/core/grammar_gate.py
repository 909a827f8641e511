"""Structured outputs: a constrained request waits for its grammar outside the batch.

A request with ``structured_outputs`` enters ``WAITING_FOR_GRAMMAR`` instead of the
waiting queue: it is not scheduled, holds no blocks and no batch slot, and no step waits
for its compile (vLLM V1's ``WAITING_FOR_FSM``). The compile itself is the executor's
(the runner owns the matchers, ``runner/grammar.py``): the gate orders it through
``SchedulerOutput.grammar_compiles`` and learns the outcome as data in
``ModelRunnerOutput.grammars_ready`` / ``grammar_errors``, so the scheduler runs no
compile and reads no clock. A ready request joins the waiting queue (the policy orders
it by its arrival as usual); a failed compile finishes that request alone, aborted with
``stop_reason`` ``"grammar_compile_failed: <why>"``.

Why not prefill while the grammar compiles (and hold back only the sampling): a request
would then hold blocks and a batch slot for as long as a slow compile takes, and the
prefill split would need a running request that may get no tokens. Waiting outside the
batch costs a constrained request one step of latency when its grammar is already
compiled (the report comes with the step after the order) and keeps every other
request's step as it was.

The runner keeps a request's compiled grammar for its whole life, so a request that is
preempted and comes back is not held again.
"""

from __future__ import annotations

from conveyor.request import Request, RequestStatus
from conveyor.structured_outputs import StructuredOutputsParams

# stop_reason prefix of a request whose grammar failed to compile (the server: HTTP 400).
GRAMMAR_FAILED = "grammar_compile_failed"
WAITING_FOR_GRAMMAR = RequestStatus.WAITING_FOR_GRAMMAR


class GrammarGate:
    def __init__(self) -> None:
        self.held: dict[str, Request] = {}  # request id -> request, its compile out
        self._orders: dict[str, StructuredOutputsParams] = {}  # not yet sent

    def __len__(self) -> int:
        return len(self.held)

    def hold(self, request: Request) -> bool:
        """Hold a new request that carries a constraint (True), ordering its compile."""
        params = request.sampling_params.structured_outputs
        if params is None:
            return False
        request.status = WAITING_FOR_GRAMMAR
        self.held[request.request_id] = request
        self._orders[request.request_id] = params
        return True

    def take_orders(self) -> dict[str, StructuredOutputsParams]:
        """The compiles to order with this step (each request once)."""
        orders, self._orders = self._orders, {}
        return orders

    def drop(self, request_id: str) -> bool:
        """A held request finished (aborted). True if its compile was ordered, so the
        runner must forget it."""
        self.held.pop(request_id, None)
        return self._orders.pop(request_id, None) is None

    def settle(self, ready: list[str], errors: dict[str, str]
               ) -> tuple[list[Request], list[tuple[Request, str]]]:
        """The held requests whose compile ended, from a step's report: (ready ones,
        (failed one, its error) pairs). Ids no longer held (aborted since) are skipped."""
        done = [r for rid in ready if (r := self.held.pop(rid, None)) is not None]
        failed = [(r, error) for rid, error in errors.items()
                  if (r := self.held.pop(rid, None)) is not None]
        return done, failed
