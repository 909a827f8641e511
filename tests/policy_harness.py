"""Drive a scheduler on a virtual clock with a fake runner (no torch, no model).

The fake runner keeps its own copy of every request as the real one does and
checks the scheduler's diffs against it (a request is sent whole once per
admission, then only its new blocks; computed counts agree; every computed
token has a KV slot), then answers each sampling request with a token that
depends only on the request id and position, never on the batch.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from conveyor.core.scheduler import Scheduler
from conveyor.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from conveyor.request import Request, RequestStatus
from conveyor.sampling_params import SamplingParams


def fake_token(request_id: str, position: int) -> int:
    return (zlib.crc32(request_id.encode()) + 7 * position) % 97 + 3


@dataclass
class _RunnerState:
    num_tokens: int
    num_computed: int
    num_blocks: int


class FakeRunner:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.states: dict[str, _RunnerState] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_req_ids:
            self.states.pop(rid, None)
        for new in out.new_reqs:
            assert new.req_id not in self.states, f"{new.req_id} sent whole twice"
            self.states[new.req_id] = _RunnerState(
                len(new.prompt_token_ids) + len(new.output_token_ids),
                new.num_computed_tokens, len(new.block_ids))
        for cached in out.cached_reqs:
            state = self.states[cached.req_id]
            assert cached.num_computed_tokens == state.num_computed, cached.req_id
            state.num_blocks += len(cached.new_block_ids)
        result = ModelRunnerOutput(lora_loaded=out.lora_load_ids)  # adapters: at once
        for rid, n in out.num_scheduled_tokens.items():
            state = self.states[rid]
            assert n >= 1 and state.num_computed + n <= state.num_tokens, rid
            state.num_computed += n
            assert state.num_blocks * self.block_size >= state.num_computed, "no KV slot"
            if rid in out.sampling_req_ids:
                assert state.num_computed == state.num_tokens
                result.sampled_token_ids[rid] = [fake_token(rid, state.num_tokens)]
                state.num_tokens += 1
            else:
                assert state.num_computed < state.num_tokens
        return result


@dataclass
class StepRecord:
    index: int
    start: float  # the clock schedule() saw
    end: float  # the clock update() saw
    out: SchedulerOutput
    admitted: list[str]  # ids admitted this step (first time or again), in admission order
    running: list[str]  # after schedule()
    waiting: list[str]  # after schedule()
    finished: list[str]
    rejected: list[str]
    running_preemptions: int  # preemptions because a running request needed a block
    admission_preemptions: int  # preemptions to admit a waiting request
    service: dict[str, float] = field(default_factory=dict)  # cumulative, per tenant


def make_req(rid: str, prompt_len: int, max_tokens: int, arrival: float = 0.0,
             prompt: list[int] | None = None, expected: int | None = None,
             **kwargs) -> Request:
    """A request that always runs to max_tokens (no eos), with its own prompt tokens."""
    if prompt is None:
        seed = zlib.crc32(rid.encode())
        prompt = [(seed + 13 * i) % 89 + 5 for i in range(prompt_len)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                            expected_output_tokens=expected)
    return Request(rid, list(prompt), params, arrival, max_tokens=max_tokens, **kwargs)


class Sim:
    """Steps a scheduler until everything finished; requests join at their arrival time.

    ``step_time(out)`` is the duration of a step on the virtual clock (default 1.0);
    a step's tokens appear at its end. ``service`` counts, per tenant, weighted tokens
    served exactly as the fair policy defines them, independently of the policy.
    """

    def __init__(self, sched: Scheduler, requests: Iterable[Request] = (),
                 step_time: Callable[[SchedulerOutput], float] | None = None,
                 input_weight: float = 1.0, output_weight: float = 2.0,
                 tenant_weights: dict[str, float] | None = None,
                 check: bool = True) -> None:
        self.sched = sched
        self.runner = FakeRunner(sched.kv.block_size)
        self.pending = sorted(requests, key=lambda r: r.arrival_time)
        self.all: dict[str, Request] = {r.request_id: r for r in self.pending}
        self.step_time = step_time or (lambda out: 1.0)
        self.now = 0.0
        self.steps: list[StepRecord] = []
        self.statuses: dict[str, RequestStatus] = {}
        self.service: dict[str, float] = {}
        self._weights = (input_weight, output_weight, tenant_weights or {})
        self._charged: set[str] = set()
        self.check = check
        self.join_order: list[str] = []  # ids in the order they were added
        # Called as after_schedule(sim, out, record) before the step runs.
        self.after_schedule: Callable[[Sim, SchedulerOutput, StepRecord], None] | None = None

    def add(self, request: Request) -> None:
        self.pending.append(request)
        self.pending.sort(key=lambda r: r.arrival_time)
        self.all[request.request_id] = request

    def _charge(self, req: Request, amount: float) -> None:
        phi = self._weights[2].get(req.tenant, 1.0)
        self.service[req.tenant] = self.service.get(req.tenant, 0.0) + amount / phi

    def step(self) -> StepRecord | None:
        sched = self.sched
        if not sched.has_unfinished():
            if not self.pending:
                return None
            self.now = max(self.now, self.pending[0].arrival_time)
        while self.pending and self.pending[0].arrival_time <= self.now:
            req = self.pending.pop(0)
            self.join_order.append(req.request_id)
            sched.add_request(req, self.now)
        stats = sched.stats
        before = (stats.num_preemptions, stats.num_admission_preemptions)
        running_before = {r.request_id for r in sched.running}
        out = sched.schedule(self.now)
        assert out.total_num_scheduled_tokens <= sched.config.max_num_batched_tokens
        assert len(sched.running) <= sched.config.max_num_seqs
        admitted = [r.request_id for r in sorted(sched.running, key=lambda r: r.admitted_seq)
                    if r.request_id not in running_before or r.request_id in
                    out.preempted_req_ids]
        admission_pre = stats.num_admission_preemptions - before[1]
        running_pre = stats.num_preemptions - before[0] - admission_pre
        for rid in admitted:
            req = self.all[rid]
            if rid not in self._charged:
                self._charged.add(rid)
                self._charge(req, self._weights[0] * (req.num_prompt_tokens
                                                      - max(req.num_cached_tokens, 0)))
        record = StepRecord(len(self.steps), self.now, self.now, out, admitted,
                            [r.request_id for r in sched.running],
                            [r.request_id for r in sched.policy.waiting()], [], [],
                            running_pre, admission_pre)
        if self.after_schedule is not None:
            self.after_schedule(self, out, record)
        run = self.runner.execute(out)
        self.now += self.step_time(out) if not out.is_empty else 1.0
        record.end = self.now
        for upd in sched.update(out, run, self.now):
            req = self.all[upd.request_id]
            if upd.new_token_ids:
                self._charge(req, self._weights[1] * len(upd.new_token_ids))
            if upd.finished:
                self.statuses[upd.request_id] = upd.status
                (record.rejected if upd.status == RequestStatus.FINISHED_REJECTED
                 else record.finished).append(upd.request_id)
        if self.check:
            sched.check_invariants()
        record.service = dict(self.service)
        self.steps.append(record)
        return record

    def run(self, max_steps: int = 20_000) -> list[StepRecord]:
        while len(self.steps) < max_steps and self.step() is not None:
            pass
        assert not self.sched.has_unfinished() and not self.pending, "did not finish"
        return self.steps

    def admission_step(self, rid: str) -> int:
        """Index of the step that first admitted ``rid``."""
        return next(s.index for s in self.steps if rid in s.admitted)
