"""Async scheduling (``--async-scheduling``): step n+1 is scheduled, and handed to the
executor, while step n runs; step n's results are folded in while step n+1 runs.

    step():   [n in flight]
        placeholders for n's sampled tokens      (core/placeholders.py)
        out(n+1) = schedule()                    overlaps step n on the executor
        submit(out(n+1))                         queued right behind step n
        run(n)   = wait for step n
        placeholders off; update(out(n), run(n)) overlaps step n+1
        return step n's outputs

The executor runs steps in order (``submit_model``: one worker thread for the local
executor; an executor without it runs each step at submission). The tokens are those
of synchronous scheduling: the runner feeds each request's real last token, and a
request that stops at step n has its step n+1 result dropped (it is no longer running
when that update comes). What differs is when decisions are made: a placeholder counts
as an output token one step early (max_tokens, policies), and the step after a stop is
wasted for that request.

Steps stay synchronous where the next schedule needs the results first: speculative
decoding (the drafts come with a step's results, and how many tokens a step accepts is
unknown until then) and a KV connector (transfers settle in ``update``).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING

from conveyor.core.placeholders import InFlightTokens
from conveyor.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from conveyor.engine.core import EngineCore
    from conveyor.engine.messages import EngineCoreOutputs


def _ran(executor, out: SchedulerOutput) -> Future:
    """A finished future of a synchronous run (executors without ``submit_model``)."""
    fut: Future = Future()
    try:
        fut.set_result(executor.execute_model(out))
    except BaseException as e:
        fut.set_exception(e)
    return fut


class AsyncSteps:
    """``EngineCore.step`` pipelined one step deep."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.inflight: tuple[SchedulerOutput, Future] | None = None
        self.tokens = InFlightTokens()
        self.num_overlapped = 0  # steps scheduled while the one before ran

    def submit(self, out: SchedulerOutput) -> Future:
        submit = getattr(self.core.executor, "submit_model", None)
        return submit(out) if submit is not None else _ran(self.core.executor, out)

    def overlappable(self, out: SchedulerOutput) -> bool:
        core = self.core
        return (core.speculation is None and core.kv_connector is None
                and not out.is_empty)

    def step(self) -> EngineCoreOutputs:
        core = self.core
        if self.inflight is None:
            out = core.schedule()
            self.inflight = (out, self.submit(out))
        out, fut = self.inflight
        self.inflight = None
        nxt: tuple[SchedulerOutput, Future] | None = None
        if self.overlappable(out):
            self.tokens.add(core.scheduler, out)
            try:
                sched = core.schedule()
            except BaseException:
                fut.exception()  # (wait: the runner must be idle before anything else)
                self.tokens.remove(core.scheduler)
                raise
            nxt = (sched, self.submit(sched))
            self.num_overlapped += 1
        try:
            run = fut.result()
        except BaseException:
            if nxt is not None:
                nxt[1].exception()  # let the next step finish; the loop fails both
            self.tokens.remove(core.scheduler)
            raise
        self.inflight = nxt
        self.tokens.remove(core.scheduler)
        return core.update(out, run if run is not None else ModelRunnerOutput())

    def drain(self) -> None:
        """Wait for the step in flight and drop it (shutdown; its requests are gone)."""
        if self.inflight is not None:
            self.inflight[1].exception()
            self.inflight = None
