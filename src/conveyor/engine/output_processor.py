"""Turns per-step token updates into ``RequestOutput``s: text, stop strings, logprobs, n > 1.

A user request with ``n`` samples is a parent with ``n`` child requests in the
scheduler. Outputs come in three kinds: ``final`` (once, when every child is
done: the offline API), ``delta`` (new text and tokens since the last output:
streaming) and ``cumulative`` (everything so far, every step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from conveyor.core.scheduler import RequestUpdate
from conveyor.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from conveyor.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from conveyor.request import Request, RequestStatus
from conveyor.sampling_params import SamplingParams

OUTPUT_KINDS = ("final", "delta", "cumulative")


@dataclass
class _Child:
    index: int
    request: Request
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

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, tuple[_Parent, _Child]] = {}

    def add(self, request_id: str, prompt: str | None, params: SamplingParams,
            children: list[Request], output_kind: str) -> None:
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {OUTPUT_KINDS}, got {output_kind!r}")
        kids = []
        for i, req in enumerate(children):
            detok = (IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids,
                                            params.skip_special_tokens)
                     if self.tokenizer is not None and params.detokenize else None)
            metrics = RequestMetrics.for_request(req)
            child = _Child(i, req, detok, metrics,
                           logprobs=[] if params.logprobs is not None else None,
                           cumulative_logprob=0.0 if params.logprobs is not None else None)
            kids.append(child)
        parent = _Parent(request_id, prompt, children[0].prompt_token_ids, params, output_kind,
                         kids)
        self.parents[request_id] = parent
        for req, child in zip(children, kids):
            self.child_to_parent[req.request_id] = (parent, child)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return [c.request.request_id for c in parent.children] if parent else []

    def process(self, updates: list[RequestUpdate], now: float
                ) -> tuple[list[RequestOutput], list[str], list[RequestMetrics]]:
        """Returns (outputs to emit, child ids finished by a stop string, finished metrics)."""
        touched: dict[str, _Parent] = {}
        stopped: list[str] = []
        for upd in updates:
            entry = self.child_to_parent.get(upd.request_id)
            if entry is None:
                continue
            parent, child = entry
            if child.finished:
                continue
            if self._apply(parent, child, upd, now):
                stopped.append(upd.request_id)
            touched[parent.request_id] = parent
        outputs, finished_metrics = [], []
        for parent in touched.values():
            done = parent.finished
            for child in parent.children:
                if child.finished and child.request.request_id in self.child_to_parent:
                    self._finalize_metrics(child, now)
                    finished_metrics.append(child.metrics)
                    del self.child_to_parent[child.request.request_id]
            if parent.output_kind != "final" or done:
                outputs.append(self._make_output(parent, done))
            if done:
                del self.parents[parent.request_id]
        return outputs, stopped, finished_metrics

    def abort(self, request_id: str, now: float
              ) -> tuple[RequestOutput, list[RequestMetrics]] | None:
        """Mark every unfinished child of a parent aborted.

        Returns the parent's last output and the metrics of the children this ended
        (children that finished earlier were reported when they did).
        """
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return None
        ended = []
        for child in parent.children:
            if not child.finished:
                child.finish_reason = "abort"
                self._finalize_metrics(child, now)
                ended.append(child.metrics)
            self.child_to_parent.pop(child.request.request_id, None)
        return self._make_output(parent, True), ended

    # ---- internals -----------------------------------------------------------------------
    def _apply(self, parent: _Parent, child: _Child, upd: RequestUpdate, now: float) -> bool:
        """Fold one update into a child; True if a stop string finished it."""
        params = parent.params
        child.token_ids.extend(upd.new_token_ids)
        child.metrics.record_tokens(len(upd.new_token_ids), now)
        if upd.new_logprobs and child.logprobs is not None:
            for token, (ids, vals, rank, lp) in zip(upd.new_token_ids, upd.new_logprobs):
                entry = {tid: Logprob(val, r + 1, self._token_text(tid))
                         for r, (tid, val) in enumerate(zip(ids, vals))}
                entry[token] = Logprob(lp, rank, self._token_text(token))
                child.logprobs.append(entry)
                child.cumulative_logprob += lp
        stopped_by_string = False
        if child.detok is not None and upd.new_token_ids:
            delta = child.detok.add(upd.new_token_ids)
            child.text = child.detok.text
            if params.stop and not upd.finished:
                hit = find_stop_string(child.text, len(delta), params.stop,
                                       params.include_stop_str_in_output)
                if hit is not None:
                    child.text = child.text[:hit[1]]
                    child.finish_reason, child.stop_reason = "stop", hit[0]
                    stopped_by_string = True
        if upd.finished and not child.finished:
            child.finish_reason = upd.status.finish_reason
            child.stop_reason = upd.stop_reason
        return stopped_by_string

    def _token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _finalize_metrics(self, child: _Child, now: float) -> None:
        child.metrics.finalize(child.request, len(child.token_ids), child.finish_reason, now)

    def _make_output(self, parent: _Parent, finished: bool) -> RequestOutput:
        delta = parent.output_kind == "delta"
        hold = max((len(s) for s in parent.params.stop), default=1) - 1
        outs = []
        for child in parent.children:
            if not child.finished and child.request.num_cached_tokens >= 0:
                child.metrics.num_cached_tokens = child.request.num_cached_tokens
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
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outs,
                             finished, first.metrics,
                             max(first.request.num_cached_tokens, 0))


def status_of(finish_reason: str) -> RequestStatus:
    return {"stop": RequestStatus.FINISHED_STOPPED,
            "length": RequestStatus.FINISHED_LENGTH_CAPPED}.get(
        finish_reason, RequestStatus.FINISHED_ABORTED)
