"""Iteration-level scheduler: forms a new batch every step under a token budget.

One step:

    out = scheduler.schedule(now)          # which requests compute how many tokens
    run = runner.execute(out)              # (elsewhere) forward + sample
    upd = scheduler.update(out, run, now)  # append tokens, stop checks, free blocks

Running decodes are served first (a token each), then running short prefills and
waiting requests in the policy's order, then running long prefills, which keep a
reserved share of the prefill tokens (core/prefill_split.py: caps on partial and long
prefills per step, and the bound on a long prompt's TTFT). When the KV pool runs dry a
running request is preempted by recompute: its blocks are freed and it rejoins
the waiting queue with ``num_computed_tokens = 0``. A waiting request that does
not fit may have running requests preempted for it when the policy names
victims (``priority``, ``fair``); nobody is preempted unless that makes room.

Shared controls, the same for every policy: ``max_num_seqs`` and
``max_num_batched_tokens`` caps; ``max_queue_len`` (the engine refuses new
requests beyond it); ``max_queue_wait_s`` (a request waiting that long since it
joined the queue is admitted before the policy's choice, or rejected with
``queue_wait_action="reject"`` if it never ran); ``max_preemptions_per_request``
(a request preempted that often is no longer offered as a victim); ``token_budget``
(``slo``: a ``BudgetController``, core/budget.py, sizes each prefill chunk from TPOT
targets and a step-cost model, ``max_num_batched_tokens`` the ceiling).

In ``static`` batching mode waiting requests are only admitted when nothing is
running: the classic baseline that holds a batch until its longest member ends.

Speculative decoding sits beside it (``core/speculation.py``): given a speculation
object, the scheduler asks it for drafts once running and waiting requests have their
tokens, and tells it what each step did; the drafts' KV slots and budget stay here.

The scheduler never imports torch and never reads a clock: ``now`` comes in.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import deque

from conveyor.config import SchedulerConfig
from conveyor.core.budget import BudgetController, budget_mode
from conveyor.core.grammar_gate import GRAMMAR_FAILED, GrammarGate
from conveyor.core.kv_cache_manager import ComputedBlocks, KVCacheManager
from conveyor.core.kv_connector import KV_TRANSFER_FAILED, SchedulerKVConnector
from conveyor.core.lora_gate import LoRAGate
from conveyor.core.lora_loads import LORA_LOAD_FAILED, LoRALoads
from conveyor.core.policies import PolicyContext, SchedulingPolicy, make_policy
from conveyor.core.prefill_split import PrefillSplit
from conveyor.core.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    RequestUpdate,
    SchedulerOutput,
)
from conveyor.core.scheduler_stats import SchedulerStats
from conveyor.core.speculation import DraftDecision, DraftStep, Speculation, StepOutcome
from conveyor.costs.protocol import StepCostModel
from conveyor.request import Request, RequestStatus

logger = logging.getLogger(__name__)

# Hot-path comparisons use this module constant: an enum member lookup costs more than the test.
_RUNNING = RequestStatus.RUNNING
_REMOTE_KV = RequestStatus.WAITING_FOR_REMOTE_KV
# stop_reason of a request the policy rejected because its TTFT target cannot be met any
# more (the server answers 429 with this code).
SLO_REJECTED = "slo_unattainable"


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 policy: SchedulingPolicy | None = None,
                 step_cost: StepCostModel | None = None,
                 connector: SchedulerKVConnector | None = None,
                 speculation: Speculation | None = None) -> None:
        """``connector``: the KV connector's scheduler half (prefill/decode disaggregation;
        None: every prompt is computed here). ``step_cost``: the SLO token budget's
        step-cost model (``core/budget.py``). ``speculation``: speculative decoding
        (``core/speculation.py``; None: off), asked for drafts each step and told what
        each step did (its time is the span from ``schedule(now)`` to ``update(...,
        now)``)."""
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.policy = policy or make_policy(config.scheduling_policy, config.policy)
        # The per-step token budget: fixed, or chosen from SLOs by a step-cost model.
        self.budget_mode, self.budget_reason = budget_mode(
            config.token_budget, self.policy.name, config.batching, step_cost)
        self.budget_ctrl: BudgetController | None = None
        if self.budget_mode == "slo":
            assert step_cost is not None
            self.budget_ctrl = BudgetController(step_cost, config.max_num_batched_tokens,
                                                config.slo_cost_scale)
        elif config.token_budget == "slo" or (config.token_budget == "auto"
                                              and self.policy.name == "slo"):
            # Wanted but not possible (no cost model, static batching): say so once.
            logger.warning("token budget: %s", self.budget_reason)
        self.policy.bind(PolicyContext(
            max_model_len=max_model_len, cached_prefix_tokens=self._cached_prefix_tokens,
            predict_prefill_s=(self.budget_ctrl.predict_prefill_s if self.budget_ctrl
                               else None)))
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._admit_seq = 0
        # Requests the runner holds state for; others are sent whole when next scheduled.
        self._runner_known: set[str] = set()
        # Ids the runner must forget at the next step (finished, aborted, preempted).
        self._dropped_ids: set[str] = set()
        self._dropped_preempted: set[str] = set()
        # Finished by the scheduler outside update() (queue-wait rejection, aborts): reported
        # by the next update() so the engine learns about them.
        self._pending_updates: list[RequestUpdate] = []
        # max_queue_wait_s: (time joined the queue, entry seq, request), oldest first; an
        # entry is live while _wait_entry[request_id] holds its seq.
        self._wait_heap: list[tuple[float, int, Request]] = []
        self._wait_entry: dict[str, int] = {}
        self._wait_seq = itertools.count()
        # Waiting requests past max_queue_wait_s, admitted before the policy's choice.
        self._overdue: deque[Request] = deque()
        self._overdue_ids: set[str] = set()
        # Block ids of each request the runner has been told about.
        self._blocks_sent: dict[str, int] = {}
        # Speculative decoding, and the requests that left since it last heard.
        self.speculation = speculation
        self._departed: list[Request] = []
        # Prefill/decode disaggregation: requests in WAITING_FOR_REMOTE_KV (their load in
        # flight, or ended and queued for a sequence slot as (id, tokens computed)).
        self.connector = connector
        self._remote: dict[str, Request] = {}
        self._remote_ready: deque[tuple[str, int]] = deque()
        self._now = 0.0  # the last time given (an abort between steps stamps with it)
        # Multi-LoRA: max_loras adapters in run (core/lora_gate.py; None: LoRA off), and
        # the waiting requests its gate set aside this step (with whether overdue).
        self.lora_gate = (LoRAGate(config.max_loras, config.lora_drain) if config.max_loras
                          else None)
        # ...and the adapters loaded ahead (core/lora_loads.py): a request runs once its
        # adapter's load is reported.
        self.lora_loads = (LoRALoads(max(config.max_cpu_loras, config.max_loras))
                           if config.max_loras else None)
        self._set_aside: list[tuple[Request, bool]] = []
        # Structured outputs: requests waiting for their grammar (core/grammar_gate.py).
        self.grammar_gate = GrammarGate()

    # ---- request lifecycle ---------------------------------------------------------------
    def add_request(self, request: Request, now: float) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        if self.grammar_gate.hold(request):
            return  # it joins the queue once its grammar is compiled (update)
        self.policy.add(request, now)
        self._track_wait(request, request.arrival_time)
        self.stats.peak_waiting = max(self.stats.peak_waiting, len(self.policy))

    def queue_full(self, num_new: int = 1) -> bool:
        """Whether admission control refuses ``num_new`` more waiting requests."""
        limit = self.config.max_queue_len
        return limit is not None and len(self.policy) + num_new > limit

    def finish_requests(self, request_ids: list[str] | str, status: RequestStatus) -> None:
        """Finish requests from outside the step (abort, stop string); unknown ids are ignored."""
        assert status.is_finished
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == _REMOTE_KV:
                self._remote.pop(rid)
                self.connector.request_aborted(rid, self._now)
            elif req.status == RequestStatus.WAITING_FOR_GRAMMAR:
                pass  # (the gate lets it go in _finish)
            else:
                self.policy.pop(req)
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.kv.free(req.request_id)
        self.requests.pop(req.request_id, None)
        if req.request_id in self._runner_known:
            self._runner_known.discard(req.request_id)
            self._dropped_ids.add(req.request_id)
        self._blocks_sent.pop(req.request_id, None)
        self._wait_entry.pop(req.request_id, None)
        self._overdue_ids.discard(req.request_id)
        self.policy.on_finished(req)
        self.grammar_gate.finished(req.request_id)
        if self.speculation is not None:
            self._departed.append(req)

    def _cached_prefix_tokens(self, req: Request) -> int:
        """The policy's one window on the KV cache: prompt tokens it holds for ``req``."""
        return self.kv.get_computed_blocks(req).num_tokens

    @property
    def num_waiting(self) -> int:
        return len(self.policy)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        """Requests, or KV transfers still to settle (their reports arrive with steps)."""
        return bool(self.requests) or (self.connector is not None
                                       and self.connector.has_work())

    # ---- schedule ------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        preempted: list[Request] = []
        admit_allowed = self.config.batching == "continuous" or not self.running
        ctrl = self.budget_ctrl
        if ctrl is not None:  # the ceiling stays ``budget``; the controller prices chunks
            ctrl.begin_step(now, self.running)

        self._apply_queue_wait_limit(now)
        for req in self.policy.reject_waiting(now):
            self._reject(req, now, SLO_REJECTED)
        self._now = now
        if self.connector is not None:
            for rid, error in self.connector.expire(now):
                self._load_ended(rid, error, now)
            self._admit_remote_ready(now)
        if self.lora_gate is not None:
            self.lora_gate.begin_step(self.running, self.policy.waiting())
            self.lora_loads.plan(self.lora_gate.in_run, self.lora_gate.blocked_order(),
                                 self.policy.waiting())
        decodes: list[Request] = []
        budget, split = self._schedule_running(scheduled, preempted, budget, now, decodes)
        if not preempted and admit_allowed:
            budget = split.reserve + self._schedule_waiting(
                scheduled, preempted, budget - split.reserve, now, split)
        self._restore_set_aside(now)
        budget = self._schedule_long_prefills(split, scheduled, preempted, budget, now,
                                              decodes)
        drafts = None
        if self.speculation is not None:  # (within what prefill left of the budget)
            drafts = self.speculation.plan(DraftStep(
                now, self.stats.num_steps, decodes, scheduled, budget, self.requests, self.kv,
                self.budget_ctrl, self.max_model_len, self._take_departed()))
        out = self._build_output(scheduled, preempted, now, drafts)
        if self.connector is not None:
            out.kv_connector_meta = self.connector.build_connector_meta()
        if self.lora_loads is not None:
            out.lora_load, out.lora_release = self.lora_loads.take_orders()
        out.grammar_compiles, out.grammar_evictions = self.grammar_gate.take_orders()
        if ctrl is not None:
            ctrl.end_step(out.total_num_scheduled_tokens)
        return out

    def _schedule_running(self, scheduled: dict[str, int], preempted: list[Request],
                          budget: int, now: float, decodes: list[Request]
                          ) -> tuple[int, PrefillSplit]:
        """Serve running decodes, then running short prefills (core/prefill_split.py: the
        long ones go after the waiting requests); ``decodes`` collects the decoding ones
        (draft candidates). Returns the budget left and the step's prefill plan."""
        prefills: list[Request] = []
        for req in self.policy.order_running(list(self.running)):
            if req.status != _RUNNING:
                continue  # preempted earlier in this loop
            if req.num_uncomputed_tokens > 1:
                prefills.append(req)
            elif budget > 0:
                budget, _ = self._serve(req, budget, budget, scheduled, preempted, now,
                                        decodes)
        split = PrefillSplit.plan(self.config, prefills, budget)
        if split.reserve and (head := self._next_waiting(now)) is not None \
                and self.policy.outranks_long_prefill(head, split.advancing_long[0]):
            split.waive()  # (priority) an urgent arrival pauses the long prefill
        for req in split.short:
            if req.status != _RUNNING or budget - split.reserve <= 0:
                continue
            left = req.num_uncomputed_tokens
            if not split.may_advance(left, min(left, budget - split.reserve)):
                continue  # the partial-prefill cap is full: it pauses this step
            budget, num_new = self._serve(req, budget, budget - split.reserve, scheduled,
                                          preempted, now, decodes)
            split.count(left, num_new)
        return budget, split

    def _schedule_long_prefills(self, split: PrefillSplit, scheduled: dict[str, int],
                                preempted: list[Request], budget: int, now: float,
                                decodes: list[Request]) -> int:
        """The advancing long prefills take what is left (at least their reserve); the
        others pause with their blocks. Requests admitted this step are no victims."""
        for req in split.advancing_long:
            left = req.num_uncomputed_tokens
            if req.status == _RUNNING and budget > 0 and (
                    not split.waived or split.may_advance(left, min(left, budget))):
                budget, got = self._serve(req, budget, budget, scheduled, preempted, now,
                                          decodes, split.admitted)
                if split.waived:
                    split.count(left, got)
        if not scheduled and self.running and self.config.batching == "continuous":
            # Liveness: the advancing one preempted itself for blocks; a paused one runs.
            for req in self.policy.order_running(list(self.running)):
                if req.status == _RUNNING and budget > 0:
                    budget, got = self._serve(req, budget, budget, scheduled, preempted,
                                              now, decodes, split.admitted)
                    if got:
                        break
        split.close_step(self.running, scheduled, now, self.stats)
        return budget

    def _serve(self, req: Request, budget: int, limit: int, scheduled: dict[str, int],
               preempted: list[Request], now: float, decodes: list[Request],
               protected: set[str] | frozenset[str] = frozenset()) -> tuple[int, int]:
        """Give running ``req`` up to ``limit`` tokens, preempting for its blocks if need
        be (never one of ``protected``). Returns (budget left, tokens it got)."""
        num_new = min(req.num_uncomputed_tokens, limit,
                      self.max_model_len - req.num_computed_tokens)
        priced = num_new > 1 and self.budget_ctrl is not None  # a prefill chunk
        if priced:
            num_new = self.budget_ctrl.fit(req, req.num_computed_tokens, num_new)
        if num_new <= 0:
            return budget, 0  # static mode: admitted, waiting for its first chunk
        while self.kv.allocate_slots(req, num_new) is None:
            victim = self._pick_victim(req, protected)
            budget += scheduled.pop(victim.request_id, 0)
            self._preempt(victim, now)
            preempted.append(victim)
            if victim is req:
                break
        if req.status != _RUNNING:
            return budget, 0
        scheduled[req.request_id] = num_new
        budget -= num_new
        if priced:
            self.budget_ctrl.add(req, req.num_computed_tokens, num_new)
        if num_new == 1 and req.num_uncomputed_tokens == 1:
            decodes.append(req)
        return budget, num_new

    def _pick_victim(self, requester: Request,
                     protected: set[str] | frozenset[str] = frozenset()) -> Request:
        candidates = [r for r in self._preemptible(requester)
                      if r.request_id not in protected]
        victim = self.policy.select_victim(candidates, requester)
        return victim if victim is not None else requester

    def _preemptible(self, requester: Request) -> list[Request]:
        """Running requests that may be chosen as victims (the preemption cap protects)."""
        limit = self.config.max_preemptions_per_request
        return [r for r in self.running
                if limit is None or r.num_preemptions < limit or r is requester]

    def _preempt(self, req: Request, now: float) -> None:
        self.running.remove(req)
        if self.lora_gate is not None:
            self.lora_gate.left(req)
        self.kv.free(req.request_id)
        req.spec_token_ids = []
        req.spec_proposed_len, req.spec_proposed_step = 0, -2  # (its draft K/V is gone)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.paused_since = None
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        if req.request_id in self._runner_known:
            self._runner_known.discard(req.request_id)
            self._dropped_preempted.add(req.request_id)
        self._blocks_sent.pop(req.request_id, None)
        self.policy.requeue(req, now)
        self._track_wait(req, now)

    def _schedule_waiting(self, scheduled: dict[str, int], preempted: list[Request],
                          budget: int, now: float, split: PrefillSplit) -> int:
        """Admit in the policy's order; stop at the first request that cannot get room.
        A long prompt that finds the long-prefill cap full is admitted paused (no tokens
        this step) or, when no more long prefills may hold slots, stays queued and is
        passed over this step: either way the requests behind it pass. Returns the
        budget left."""
        admitted = split.admitted  # admitted in this step: never preempted for another
        while (req := self._next_waiting(now)) is not None:
            if self.lora_gate is not None and not (self.lora_gate.may_admit(req)
                                                   and self.lora_loads.is_ready(req)):
                self._put_aside(req)  # its adapter cannot run this step: the scan goes on
                continue
            if (self.connector is not None
                    and self.connector.get_num_new_matched_tokens(req) > 0):
                if not self._start_remote_load(req, now):
                    return budget  # no room for its blocks yet: the queue waits
                continue
            computed = self.kv.get_computed_blocks(req)
            num_new = self._admission_tokens(req, computed, budget)
            left = req.num_tokens - computed.num_tokens
            if self.config.batching == "continuous":
                if split.is_long(left) and split.long_full:
                    if not split.may_admit_paused:
                        if not split.pass_over():
                            return budget  # too many long prompts passed: the queue waits
                        self._put_aside(req)  # it waits for the long cap; the rest pass
                        continue
                    num_new = 0  # admitted paused: it waits for the long cap, not the queue
                elif num_new is not None and not split.may_advance(left, num_new):
                    return budget  # the partial-prefill cap is full
            if (num_new is not None and len(self.running) < self.config.max_num_seqs
                    and self.kv.allocate_slots(req, num_new, computed) is not None):
                self.policy.pop(req)
                self._admit(req, computed.num_tokens, now)
                if num_new > 0:  # (one admitted paused published nothing: it may yield)
                    admitted.add(req.request_id)
                split.count(left, num_new)
                if num_new > 0:
                    scheduled[req.request_id] = num_new
                    budget -= num_new
                    if self.budget_ctrl is not None:
                        self.budget_ctrl.add(req, req.num_computed_tokens, num_new)
                    # Safe to publish now: an admission is never preempted within its step
                    # (``admitted`` protects it from _victims_for), so these blocks are
                    # computed this step (n > 1 siblings share them at once).
                    self.kv.cache_computed_blocks(req, req.num_computed_tokens + num_new)
                continue
            if self.config.batching == "static":
                return budget
            victims = self._victims_for(req, computed, budget, scheduled, admitted)
            if not victims:
                return budget
            for victim in victims:
                budget += scheduled.pop(victim.request_id, 0)
                self._preempt(victim, now)
                preempted.append(victim)
                self.stats.num_admission_preemptions += 1
        return budget

    # ---- prefill/decode disaggregation (decode side) --------------------------------------
    def _start_remote_load(self, req: Request, now: float) -> bool:
        """Give a waiting request whose prompt K/V a peer holds its blocks and order the
        load; it waits in WAITING_FOR_REMOTE_KV, outside the batch, so nothing else waits
        for it. False: its blocks do not fit now."""
        if self.kv.allocate_slots(req, req.num_prompt_tokens) is None:
            return False
        self.policy.pop(req)
        req.status = _REMOTE_KV
        req.num_cached_tokens = 0  # remote tokens are no prefix-cache hit
        self._remote[req.request_id] = req
        self._wait_entry.pop(req.request_id, None)
        self._overdue_ids.discard(req.request_id)
        self.connector.update_state_after_alloc(req, now)
        return True

    def _load_ended(self, rid: str, error: str | None, now: float) -> None:
        """A load ended: the request runs from all but its last prompt token, or the
        fallback applies (recompute the prompt here in the same blocks, or fail it)."""
        req = self._remote.get(rid)
        if req is None:
            return
        if error is None:
            self._remote_ready.append((rid, req.num_prompt_tokens - 1))
        elif self.connector.config.fallback == "recompute":
            logger.warning("request %s: KV transfer failed (%s); computing its prompt here",
                           rid, error)
            self._remote_ready.append((rid, 0))
        else:
            del self._remote[rid]
            req.stop_reason = f"{KV_TRANSFER_FAILED}: {error}"
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            req.finished_time = now
            self._pending_updates.append(RequestUpdate(
                rid, [], status=RequestStatus.FINISHED_ABORTED, stop_reason=req.stop_reason,
                request=req))

    def _admit_remote_ready(self, now: float) -> None:
        """Requests whose load ended join the batch, oldest first, as slots allow."""
        while self._remote_ready and len(self.running) < self.config.max_num_seqs:
            rid, num_computed = self._remote_ready.popleft()
            req = self._remote.pop(rid, None)
            if req is not None:  # else aborted since
                self._admit(req, num_computed, now)

    def _admission_tokens(self, req: Request, computed: ComputedBlocks,
                          budget: int) -> int | None:
        """Tokens a waiting request would compute if admitted now, or None if it cannot be.

        Static batching admits with 0 tokens (the batch waits for budget as a whole).
        """
        remaining = req.num_tokens - computed.num_tokens
        num_new = min(remaining, max(budget, 0))
        if num_new > 0 and self.budget_ctrl is not None:
            num_new = self.budget_ctrl.fit(req, computed.num_tokens, num_new)
        if num_new < remaining and not self.config.enable_chunked_prefill:
            num_new = 0
        if num_new == 0 and self.config.batching != "static":
            return None
        return num_new

    def _victims_for(self, req: Request, computed: ComputedBlocks, budget: int,
                     scheduled: dict[str, int], admitted: set[str]) -> list[Request]:
        """Running requests the policy would preempt so that waiting ``req`` fits.

        Asks the policy one victim at a time and counts what each would give back (a
        sequence slot, its tokens of this step's budget, the blocks only it holds)
        until ``req`` would fit; returns [] (preempt nobody) if the policy runs out of
        victims first. Shared prefix blocks are not counted as freed, so the count
        errs on the side of preempting too few; the caller then asks again.
        """
        candidates = [r for r in self._preemptible(req) if r.request_id not in admitted]
        victims: list[Request] = []
        free_seqs = self.config.max_num_seqs - len(self.running)
        free_blocks = self.kv.free_counts()  # per layer group: each must fit
        while True:
            if victims and free_seqs > 0:
                num_new = self._admission_tokens(req, computed, budget)
                if num_new is not None and all(
                        n <= f for n, f in zip(self.kv.blocks_to_take(req, num_new, computed),
                                               free_blocks)):
                    return victims
            victim = self.policy.victim_for_waiting(candidates, req)
            if victim is None:
                return []
            assert victim in candidates, f"policy {self.policy.name} named a non-candidate"
            candidates.remove(victim)
            victims.append(victim)
            free_seqs += 1
            budget += scheduled.get(victim.request_id, 0)
            free_blocks = tuple(f + n for f, n in zip(
                free_blocks, self.kv.exclusive_counts(victim.request_id)))

    def _admit(self, req: Request, num_cached: int, now: float) -> None:
        if req.num_cached_tokens < 0:  # first admission: record the prefix hit
            req.num_cached_tokens = num_cached
            self.kv.record_lookup(req.num_prompt_tokens, num_cached)
        req.num_computed_tokens = num_cached
        req.status = RequestStatus.RUNNING
        req.admitted_seq = self._admit_seq
        self._admit_seq += 1
        self.running.append(req)
        if self.lora_gate is not None:
            self.lora_gate.admitted(req)
        self._wait_entry.pop(req.request_id, None)
        self._overdue_ids.discard(req.request_id)
        self.policy.on_admitted(req, now)

    def _put_aside(self, req: Request) -> None:
        """Out of the waiting queue for the rest of this step (the LoRA gate refused it,
        or it is a long prompt waiting for the long-prefill cap)."""
        self.policy.set_aside(req)
        overdue = req.request_id in self._overdue_ids
        self._overdue_ids.discard(req.request_id)
        self._set_aside.append((req, overdue))

    def _restore_set_aside(self, now: float) -> None:
        """Set-aside requests back in the queue, where they were."""
        self.policy.restore_set_aside([req for req, _ in self._set_aside], now)
        for req, overdue in reversed(self._set_aside):
            if overdue:
                self._overdue_ids.add(req.request_id)
                self._overdue.appendleft(req)
        self._set_aside = []

    # ---- queue-wait threshold ------------------------------------------------------------
    def _track_wait(self, req: Request, now: float) -> None:
        """Start the queue-wait clock of a request joining the waiting queue."""
        if self.config.max_queue_wait_s is None:
            return
        seq = next(self._wait_seq)
        self._wait_entry[req.request_id] = seq
        heapq.heappush(self._wait_heap, (now, seq, req))

    def _next_waiting(self, now: float) -> Request | None:
        """Overdue requests (past ``max_queue_wait_s``) first, oldest first; else the policy's."""
        while self._overdue:
            req = self._overdue[0]
            if req.request_id in self._overdue_ids:
                return req
            self._overdue.popleft()
        return self.policy.peek(now)

    def _apply_queue_wait_limit(self, now: float) -> None:
        """Promote (or reject) requests that have waited ``max_queue_wait_s``: O(log n) each.

        The clock starts when a request joins the waiting queue (arrival or preemption).
        Only a request that never ran is rejected; a preempted one, which has already
        streamed output, is promoted instead.
        """
        limit = self.config.max_queue_wait_s
        if limit is None:
            return
        heap = self._wait_heap
        while heap and now - heap[0][0] >= limit:
            _, seq, req = heapq.heappop(heap)
            if self._wait_entry.get(req.request_id) != seq:
                continue  # admitted or finished since it joined the queue
            del self._wait_entry[req.request_id]
            if self.config.queue_wait_action == "reject" and req.first_scheduled_time is None:
                self.stats.num_wait_rejected += 1
                self._reject(req, now)
            else:
                self.stats.num_overdue += 1
                self._overdue_ids.add(req.request_id)
                self._overdue.append(req)

    def _reject(self, req: Request, now: float, reason: str | None = None) -> None:
        """Finish a waiting request as rejected (reported by the next update)."""
        self.policy.pop(req)
        self.stats.num_rejected += 1
        if reason == SLO_REJECTED:
            self.stats.num_slo_rejected += 1
        req.stop_reason = reason
        self._finish(req, RequestStatus.FINISHED_REJECTED)
        req.finished_time = now
        self._pending_updates.append(
            RequestUpdate(req.request_id, [], status=RequestStatus.FINISHED_REJECTED,
                          stop_reason=reason, request=req))

    def _build_output(self, scheduled: dict[str, int], preempted: list[Request],
                      now: float, drafts: DraftDecision | None) -> SchedulerOutput:
        out = SchedulerOutput(num_scheduled_tokens=scheduled,
                              total_num_scheduled_tokens=sum(scheduled.values()),
                              finished_req_ids=self._dropped_ids | self._dropped_preempted,
                              preempted_req_ids={r.request_id for r in preempted})
        self._dropped_ids = set()
        self._dropped_preempted = set()
        spec_tokens = None
        if drafts is not None:
            spec_tokens = out.scheduled_spec_tokens = drafts.spec_tokens
            out.num_spec_wanted, out.num_spec_catch_up = drafts.wanted, drafts.catch_up
        # Locals for the per-request loop (it runs for every request of every step).
        requests, known, sent, block_ids_of = (self.requests, self._runner_known,
                                               self._blocks_sent, self.kv.block_ids)
        cached_reqs, on_scheduled = out.cached_reqs, self.policy.on_scheduled
        window_ids_of = self.kv.window_block_ids  # a hybrid model's windowed layers' table
        for rid, n in scheduled.items():
            req = requests[rid]
            if rid in known:
                # Only the blocks added since the last step (the table only grows, but
                # for lookahead blocks speculative decoding gave back: see ``trim``).
                first = sent[rid]
                new_ids = block_ids_of(rid, first)
                cached_reqs.append(CachedRequestData(rid, new_ids, req.num_computed_tokens,
                                                     first, window_ids_of(rid, first)))
                sent[rid] = first + len(new_ids)
            else:
                self._runner_known.add(rid)
                block_ids = self.kv.block_ids(rid)
                out.new_reqs.append(NewRequestData(
                    rid, req.prompt_token_ids, req.output_token_ids[:], req.sampling_params,
                    block_ids, req.num_computed_tokens, req.lora_request,
                    window_ids_of(rid)))
                self._blocks_sent[rid] = len(block_ids)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            on_scheduled(req, n, now)
            prompt_left = req.num_prompt_tokens - req.num_computed_tokens
            if prompt_left > 0:
                self.stats.num_prompt_tokens_computed += min(n, prompt_left)
            req.num_computed_tokens += n
            # Its drafts come after its last real token: it samples if that is reached.
            num_drafts = len(spec_tokens[rid]) if spec_tokens and rid in spec_tokens else 0
            if req.num_computed_tokens - num_drafts == len(req.all_token_ids):
                out.sampling_req_ids.add(rid)
                if req.kv_params is not None and self.connector is not None:
                    self.connector.will_save(req)  # a prefill engine's: serve its K/V
        self.stats.num_steps += 1 if scheduled else 0
        self.stats.total_scheduled_tokens += out.total_num_scheduled_tokens
        self.stats.peak_running = max(self.stats.peak_running, len(self.running))
        if scheduled:
            self.stats.num_batched_rows += len(scheduled)
            self.stats.last_step_batch_size = len(scheduled)
        return out

    # ---- update --------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, run: ModelRunnerOutput,
               now: float) -> list[RequestUpdate]:
        self._now = now
        if self.connector is not None:
            for rid, error in self.connector.update_from_output(run.kv_report, now):
                self._load_ended(rid, error, now)
        if self.lora_loads is not None and (run.lora_loaded or run.lora_failed):
            for lora_id, error in self.lora_loads.on_report(run.lora_loaded,
                                                            run.lora_failed).items():
                for req in [r for r in self.policy.waiting() if r.lora_id == lora_id]:
                    self._reject(req, now, f"{LORA_LOAD_FAILED}: {error}")
        if run.grammars_ready or run.grammar_errors:
            self._grammars_settled(run, now)
        updates = self._pending_updates
        self._pending_updates = []
        speculation = self.speculation
        verified: list[tuple[Request, int, int, int]] = []
        num_proposed = 0
        # Locals for the per-request loop (it runs for every request of every step).
        get_request, cache_blocks, sampled = (self.requests.get, self.kv.cache_computed_blocks,
                                              run.sampled_token_ids)
        spec_tokens, proposals = out.scheduled_spec_tokens, run.spec_token_ids
        # Requests holding lookahead slots (a draft model's): they may have some to give back.
        lookahead = (out.num_spec_wanted if speculation is not None
                     and speculation.writes_draft_kv else ())
        for rid in out.num_scheduled_tokens:
            req = get_request(rid)
            if req is None or req.status != _RUNNING:
                continue  # aborted or preempted while the step ran
            new_tokens = sampled.get(rid)
            if spec_tokens and rid in spec_tokens:
                verified.append(self._roll_back_rejected(req, len(spec_tokens[rid]),
                                                         new_tokens))
            cache_blocks(req)
            if rid in run.prompt_logprobs:
                req.add_prompt_logprobs(*run.prompt_logprobs[rid])
            if proposals and rid in proposals:
                req.spec_token_ids = proposals[rid]
                num_proposed += len(req.spec_token_ids)
            if not new_tokens:
                continue  # a prefill chunk that did not reach the end
            accepted: list[int] = []
            for token in new_tokens:
                req.append_output_token(token)
                accepted.append(token)
                status = self._check_stop(req, token)
                if status is not None:
                    break
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            self.policy.on_tokens_generated(req, len(accepted))
            logprobs = run.logprobs.get(rid)
            update = RequestUpdate(rid, accepted,
                                   logprobs[:len(accepted)] if logprobs else None,
                                   req.take_prompt_logprobs(), request=req)
            if status is not None:
                self.running.remove(req)
                if req.kv_params is not None and self.connector is not None:
                    self.connector.request_finished(req, now)  # a lease may keep its blocks
                self._finish(req, status)
                req.finished_time = now
                update.status = status
                update.stop_reason = req.stop_reason
            elif (spec_tokens and rid in spec_tokens) or rid in lookahead:
                self._trim_lookahead(req, out.num_spec_wanted.get(rid, 0))
            updates.append(update)
        if speculation is not None:
            speculation.observe(StepOutcome(out, run, now, verified, num_proposed,
                                            self._take_departed()))
        return updates

    def _grammars_settled(self, run: ModelRunnerOutput, now: float) -> None:
        """Compiled: the request joins the waiting queue. Failed: it alone finishes."""
        ready, failed = self.grammar_gate.settle(run.grammars_ready, run.grammar_errors)
        for req in ready:
            req.status = RequestStatus.WAITING
            self.policy.add(req, now)
            self._track_wait(req, now)
        for req, error in failed:
            req.stop_reason = f"{GRAMMAR_FAILED}: {error}"
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            req.finished_time = now
            self._pending_updates.append(RequestUpdate(
                req.request_id, [], status=RequestStatus.FINISHED_ABORTED,
                stop_reason=req.stop_reason, request=req))

    def _take_departed(self) -> list[Request]:
        """Requests that left since speculation last heard (it learns from their record)."""
        departed, self._departed = self._departed, []
        return departed

    def _roll_back_rejected(self, req: Request, num_drafts: int, new_tokens: list[int] | None
                            ) -> tuple[Request, int, int, int]:
        """The one place ``num_computed_tokens`` moves back: the rejected drafts' K/V
        (computed this step) is void. (Their blocks go back in ``_trim_lookahead``.)
        Returns the verification for speculation: (request, drafts, accepted, output
        tokens before this step's)."""
        num_accepted = len(new_tokens) - 1 if new_tokens else 0
        assert 0 <= num_accepted <= num_drafts, (req.request_id, num_drafts, new_tokens)
        req.num_computed_tokens -= num_drafts - num_accepted
        return req, num_drafts, num_accepted, req.num_output_tokens

    def _trim_lookahead(self, req: Request, num_wanted: int) -> None:
        """Give back the blocks beyond what the request's tokens need (a draft model's
        lookahead, ``num_wanted`` slots, stays: its proposals' K/V lives there)."""
        keep = req.num_tokens + (num_wanted if self.speculation.writes_draft_kv else 0)
        if self.kv.trim(req, keep):
            rid = req.request_id
            if rid in self._blocks_sent:
                self._blocks_sent[rid] = min(self._blocks_sent[rid],
                                             len(self.kv.req_blocks[rid]))

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        num_output = len(req.output_token_ids)  # hot path: no property calls
        if num_output >= sp.min_tokens:
            if not sp.ignore_eos and token in sp.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output >= req.max_tokens or len(req.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    # ---- checking ------------------------------------------------------------------------
    def check_invariants(self) -> None:
        self.kv.check_invariants()
        assert len(self.running) <= self.config.max_num_seqs
        for req in self.running:
            assert req.status == RequestStatus.RUNNING
            assert self.requests.get(req.request_id) is req
        for req in self.policy.waiting():
            assert req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert req.request_id not in self.kv.req_blocks, "a waiting request holds blocks"
        for req in self._remote.values():
            assert req.status == _REMOTE_KV and self.requests.get(req.request_id) is req
            assert req.request_id in self.kv.req_blocks, "a remote-KV request holds no blocks"
        for req in self.grammar_gate.held.values():
            assert req.status == RequestStatus.WAITING_FOR_GRAMMAR
            assert req.request_id not in self.kv.req_blocks, "a request holds blocks early"
        assert (len(self.running) + len(self.policy) + len(self._remote)
                + len(self.grammar_gate) == len(self.requests))
        for rid in self.kv.req_blocks:
            assert rid in self.requests, f"finished request {rid} still holds blocks"
        if self.connector is not None:
            self.check_block_ownership()

    def check_block_ownership(self) -> None:
        """Every block is in exactly one of: the free list, a request's table, an in-flight
        transfer (prefix sharing off; with it, ref counts are checked by the manager)."""
        free = set(self.kv.pool.free_queue())
        transfer = self.connector.owned_blocks()
        loading = {rid for rid in self._remote if self.connector.is_loading(rid)}
        owners: dict[int, int] = {}
        for rid, blocks in self.kv.req_blocks.items():
            for b in blocks:
                if rid in loading:
                    assert transfer.get(b) is not None, (rid, b)
                    continue  # counted as the transfer's
                owners[b] = owners.get(b, 0) + 1
        for key, blocks in self.kv.detached.items():
            assert all(transfer.get(b) == key for b in blocks), key
        for bid in range(self.kv.num_blocks):
            n = (bid in free) + (bid in transfer) + owners.get(bid, 0)
            if not self.kv.enable_prefix_caching:
                assert n == 1, f"block {bid}: {n} owners (free {bid in free}, " \
                               f"transfer {transfer.get(bid)}, requests {owners.get(bid, 0)})"
            else:
                assert n >= 1, f"block {bid} has no owner"
