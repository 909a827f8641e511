"""The front end's request state: turns the core's token ids into ``RequestOutput``s.

It owns everything textual and per-user-request: detokenization, stop strings, logprob
text, the n > 1 fan-out (a user request with ``n`` samples is a parent whose ``n``
children are separate core requests, ``<id>#<k>``), and per-request metrics. A stop
string it finds finishes the child here at once and is returned, so that the caller
aborts that child in the core with reason "stop" (the core never sees text).

Outputs come in three kinds: ``final`` (once, when every child is done: the offline
API), ``delta`` (new text and tokens since the last output: streaming) and
``cumulative`` (everything so far, every step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.config import PolicyConfig
from conveyor.config.lora import LoRARequest
from conveyor.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from conveyor.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from conveyor.kv_transfer.messages import KVTransferParams
from conveyor.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from conveyor.sampling_params import SamplingParams

OUTPUT_KINDS = ("final", "delta", "cumulative")


def fan_out(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            arrival_time: float, *, priority: int = 0, tenant: str | None = None,
            slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
            kv_transfer_params: KVTransferParams | None = None,
            lora_request: LoRARequest | None = None) -> list[EngineCoreRequest]:
    """The core requests of one user request: one per sample, seeds ``seed + k``."""
    n = params.n
    if kv_transfer_params is not None and n != 1:
        raise ValueError("kv_transfer_params needs n == 1 (one sequence per transfer)")
    out = []
    for k in range(n):
        # The prompt's logprobs are the same for every sample: the first one computes them.
        child = params if n == 1 else params.clone(
            n=1, seed=params.seed + k if params.seed is not None else None,
            prompt_logprobs=params.prompt_logprobs if k == 0 else None)
        out.append(EngineCoreRequest(request_id if n == 1 else f"{request_id}#{k}",
                                     prompt_token_ids, child, arrival_time, priority,
                                     tenant or "default", slo_ttft_ms, slo_tpot_ms,
                                     kv_transfer_params, lora_request))
    return out


@dataclass
class _Child:
    index: int
    request_id: str
    detok: IncrementalDetokenizer | None
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_chars: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    output_kind: str
    children: list[_Child]
    # [None, then one dict per prompt token after the first], once the core sent them.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer: Any | None, policy: PolicyConfig | None = None) -> None:
        self.tokenizer = tokenizer
        policy = policy or PolicyConfig()
        self._slo_defaults = (policy.default_slo_ttft_s, policy.default_slo_tpot_s)
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, tuple[_Parent, _Child]] = {}

    def add(self, request_id: str, prompt: str | None, params: SamplingParams,
            children: list[EngineCoreRequest], output_kind: str) -> None:
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {output_kind!r}")
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_ids = children[0].prompt_token_ids
        kids = []
        for i, req in enumerate(children):
            metrics = RequestMetrics.for_core_request(req, *self._slo_defaults)
            child = _Child(i, req.request_id, None, metrics,
                           logprobs=[] if params.logprobs is not None else None,
                           cumulative_logprob=0.0 if params.logprobs is not None else None)
            if self.tokenizer is not None and params.detokenize:
                # It reads the child's token list: one copy of a sample's tokens here.
                child.detok = IncrementalDetokenizer(self.tokenizer, prompt_ids,
                                                     params.skip_special_tokens,
                                                     outputs=child.token_ids)
            kids.append(child)
        parent = _Parent(request_id, prompt, prompt_ids, params, output_kind, kids)
        self.parents[request_id] = parent
        for child in kids:
            self.child_to_parent[child.request_id] = (parent, child)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [c.request_id for c in parent.children] if parent else []

    def parent_of(self, child_id: str) -> str | None:
        entry = self.child_to_parent.get(child_id)
        return entry[0].request_id if entry is not None else None

    def process(self, outs: EngineCoreOutputs
                ) -> tuple[list[RequestOutput], list[tuple[str, str]], list[RequestMetrics]]:
        """Returns (outputs to emit, (child id, stop string) of the children a stop string
        finished, the metrics of the children that finished)."""
        now = outs.timestamp
        touched: dict[str, _Parent] = {}
        stopped: list[tuple[str, str]] = []
        for out in outs.outputs:
            entry = self.child_to_parent.get(out.request_id)
            if entry is None:
                continue
            parent, child = entry
            if child.finished:
                continue  # e.g. tokens of a step that ran before the core saw a stop
            stop = self._apply(parent, child, out, now)
            if stop is not None:
                stopped.append((out.request_id, stop))
            touched[parent.request_id] = parent
        outputs, finished = self._emit(touched.values(), now)
        return outputs, stopped, finished

    def abort(self, request_id: str, now: float,
              finals: list[EngineCoreOutput] | None = None
              ) -> tuple[RequestOutput, list[RequestMetrics]] | None:
        """Mark every unfinished child of a parent aborted (``finals``: what the core said
        of them as it let them go). Returns the parent's last output and the metrics of the
        children this ended (children that finished earlier were reported when they did)."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return None
        by_id = {o.request_id: o for o in finals or []}
        ended = []
        for child in parent.children:
            if not child.finished:
                if child.request_id in by_id:
                    child.metrics.observe(by_id[child.request_id])
                child.finish_reason = "abort"
                child.metrics.finalize("abort", now)
                ended.append(child.metrics)
            self.child_to_parent.pop(child.request_id, None)
        return self._make_output(parent, True), ended

    def fail(self, request_id: str) -> None:
        """Forget a request the core refused or lost (its error is reported elsewhere)."""
        parent = self.parents.pop(request_id, None)
        if parent is not None:
            for child in parent.children:
                self.child_to_parent.pop(child.request_id, None)

    # ---- internals -----------------------------------------------------------------------
    def _emit(self, parents, now: float) -> tuple[list[RequestOutput], list[RequestMetrics]]:
        outputs: list[RequestOutput] = []
        finished: list[RequestMetrics] = []
        for parent in parents:
            done = parent.finished
            for child in parent.children:
                if child.finished and child.request_id in self.child_to_parent:
                    child.metrics.finalize(child.finish_reason, now)
                    finished.append(child.metrics)
                    del self.child_to_parent[child.request_id]
            if parent.output_kind != "final" or done:
                outputs.append(self._make_output(parent, done))
            if done:
                del self.parents[parent.request_id]
        return outputs, finished

    def _apply(self, parent: _Parent, child: _Child, out: EngineCoreOutput,
               now: float) -> str | None:
        """Fold one core output into a child; the stop string if one finished it."""
        params = parent.params
        tokens = out.new_token_ids
        child.metrics.observe(out)
        if tokens:
            child.token_ids.extend(tokens)
            child.metrics.record_tokens(len(tokens), now)
        if out.new_logprobs and child.logprobs is not None:
            for token, scored in zip(tokens, out.new_logprobs):
                entry = self._logprob_entry(token, scored)
                child.logprobs.append(entry)
                child.cumulative_logprob += scored[3]
        if out.prompt_logprobs is not None and parent.prompt_logprobs is None:
            prompt = parent.prompt_token_ids
            parent.prompt_logprobs = [None] + [self._logprob_entry(prompt[i + 1], scored)
                                               for i, scored in enumerate(out.prompt_logprobs)]
        if child.detok is not None and tokens:
            delta = child.detok.add(tokens)
            child.text = child.detok.text
            if params.stop and not out.finished:
                hit = find_stop_string(child.text, len(delta), params.stop,
                                       params.include_stop_str_in_output)
                if hit is not None:
                    child.text = child.text[:hit[1]]
                    child.finish_reason, child.stop_reason = "stop", hit[0]
                    child.metrics.finished_time = now
                    return hit[0]
        if out.finished:
            child.finish_reason = out.finish_reason
            child.stop_reason = out.stop_reason
        return None

    def _logprob_entry(self, token: int, scored: tuple[list[int], list[float], int, float]
                       ) -> dict[int, Logprob]:
        """token id -> Logprob: the top alternatives by rank, and the token itself."""
        ids, vals, rank, lp = scored
        entry = {tid: Logprob(val, r + 1, self._token_text(tid))
                 for r, (tid, val) in enumerate(zip(ids, vals))}
        entry[token] = Logprob(lp, rank, self._token_text(token))
        return entry

    def _token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _make_output(self, parent: _Parent, finished: bool) -> RequestOutput:
        delta = parent.output_kind == "delta"
        hold = max((len(s) for s in parent.params.stop), default=1) - 1
        outs = []
        for child in parent.children:
            text, tokens, lps = child.text, child.token_ids, child.logprobs
            if delta:
                # Hold back text that could still turn out to be the start of a stop string.
                end = len(text) if child.finished else max(child.sent_chars, len(text) - hold)
                text = text[child.sent_chars:end]
                tokens = tokens[child.sent_tokens:]
                lps = lps[child.sent_tokens:] if lps is not None else None
                child.sent_chars = end
                child.sent_tokens = len(child.token_ids)
            outs.append(CompletionOutput(child.index, text, list(tokens), child.cumulative_logprob,
                                         lps, child.finish_reason, child.stop_reason))
        first = parent.children[0]
        prompt_logprobs = parent.prompt_logprobs
        if delta and prompt_logprobs is not None:  # a stream carries them once
            prompt_logprobs = None if parent.prompt_logprobs_sent else prompt_logprobs
            parent.prompt_logprobs_sent = True
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outs,
                             finished, first.metrics, first.metrics.num_cached_tokens,
                             prompt_logprobs)
