"""Async scheduling's placeholders: the tokens a running step will sample, counted before
they are known, so that the next step can be scheduled while this one runs.

Before step n+1 is scheduled, every request that samples in step n (and still runs)
gets one placeholder output token: the scheduler then sees it one token longer, exactly
as it will be after step n, and schedules its next position (the runner, which sampled
that token itself, feeds the real one). Before step n's results are folded in, the
placeholders come off again and ``Scheduler.update`` appends the sampled tokens as it
always does. A placeholder never reaches the runner (it reads its own tokens), the front
end, or a block hash that outlives it (memoized hashes past it are dropped).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.request import RequestStatus

if TYPE_CHECKING:
    from conveyor.core.scheduler import Scheduler
    from conveyor.core.scheduler_output import SchedulerOutput

PLACEHOLDER = -1  # no vocabulary has it: it can match no cached block


class InFlightTokens:
    """The placeholders of the one step in flight."""

    def __init__(self) -> None:
        self.request_ids: list[str] = []

    def add(self, scheduler: Scheduler, out: SchedulerOutput) -> None:
        """One placeholder for each request that samples in ``out`` and still runs."""
        assert not self.request_ids, "one step in flight at a time"
        for rid in out.sampling_req_ids:
            req = scheduler.requests.get(rid)
            if req is not None and req.status == RequestStatus.RUNNING:
                req.append_output_token(PLACEHOLDER)
                self.request_ids.append(rid)

    def remove(self, scheduler: Scheduler) -> None:
        """Take the placeholders off (whatever became of their requests meanwhile: a
        preempted one drops its sampled token and computes it again, the same token for
        greedy and seeded sampling)."""
        for rid in self.request_ids:
            req = scheduler.requests.get(rid)
            if req is None:
                continue  # finished or aborted meanwhile
            assert req.output_token_ids[-1] == PLACEHOLDER, rid
            req.output_token_ids.pop()
            req.all_token_ids.pop()
            scheduler.kv.forget_hashes_from(rid, len(req.all_token_ids))
        self.request_ids = []
