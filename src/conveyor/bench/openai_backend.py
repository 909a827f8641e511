"""Replay a workload against any OpenAI-compatible server: streaming ``/v1/completions``.

Each request is sent at its arrival time (asyncio, one connection each), with the
prompt as token ids (or text), ``max_tokens`` = the workload's output length and
``ignore_eos: true`` as an extra body field (vLLM, llama.cpp and conveyor honour it;
``--openai-extra-body`` adds or removes fields for other servers). Timing is
client-side: TTFT at the first streamed token, ITL between streamed chunks. The
output token count is the server's ``usage.completion_tokens`` when it sends usage,
else the number of content chunks.

The client fills a ``RequestMetrics`` per request, so records and summaries are the
same as the in-process engine's (queue time, preemptions and KV usage are the
server's secrets: reported as unknown).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from conveyor.bench.metrics import RequestRecord, RunResult, summarize
from conveyor.bench.workload import BenchRequest
from conveyor.outputs import RequestMetrics


@dataclass
class OpenAITarget:
    base_url: str  # http://host:port, with or without /v1
    model: str
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)  # None values delete a field
    api_key: str | None = None
    timeout_s: float | None = None
    max_concurrency: int | None = None
    # request id -> prompt text, for servers that do not take token-id prompts
    prompt_texts: dict[str, str] | None = None

    @property
    def url(self) -> str:
        base = self.base_url.rstrip("/")
        if base.endswith("/completions"):
            return base
        if base.endswith("/v1"):
            return base + "/completions"
        return base + "/v1/completions"

    def body(self, req: BenchRequest) -> dict[str, Any]:
        prompt: Any = req.prompt_token_ids
        if self.prompt_texts is not None:
            prompt = self.prompt_texts[req.request_id]
        body: dict[str, Any] = {
            "model": self.model, "prompt": prompt, "max_tokens": req.output_len,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        for key, value in self.extra_body.items():
            if value is None:
                body.pop(key, None)
            else:
                body[key] = value
        return body


class StreamError(RuntimeError):
    pass


def run_openai(requests: list[BenchRequest], target: OpenAITarget, *, label: str = "openai",
               progress: bool = True) -> RunResult:
    return asyncio.run(_run_all(requests, target, label, progress))


async def _run_all(requests: list[BenchRequest], target: OpenAITarget, label: str,
                   progress: bool) -> RunResult:
    import httpx
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # trust_env=False: a proxy between client and server would distort every latency.
    client = httpx.AsyncClient(timeout=httpx.Timeout(target.timeout_s), limits=limits,
                               headers=headers, trust_env=False)
    gate = asyncio.Semaphore(target.max_concurrency) if target.max_concurrency else None
    bar = tqdm(total=len(requests), desc=label, unit="req", disable=not progress, leave=False)
    clock = time.perf_counter
    t0 = clock()

    async def one(req: BenchRequest) -> RequestRecord:
        await asyncio.sleep(max(0.0, t0 + req.arrival_s - clock()))
        if gate is None:
            record = await _send(client, target, req, t0, clock)
        else:
            async with gate:
                record = await _send(client, target, req, t0, clock)
        bar.update(1)
        return record

    try:
        records = await asyncio.gather(*(one(r) for r in requests))
    finally:
        bar.close()
        await client.aclose()
    duration = clock() - t0
    summary = summarize(list(records), duration, peak_kv_usage=None,
                        extra={"backend": "openai", "url": target.url, "model": target.model})
    summary.num_preemptions = None  # not visible from the client
    return RunResult(label, list(records), summary)


async def _send(client, target: OpenAITarget, req: BenchRequest, t0: float,
                clock) -> RequestRecord:
    import httpx

    start = clock()
    metrics = RequestMetrics(arrival_time=start, request_id=req.request_id,
                             num_prompt_tokens=req.prompt_len,
                             tenant=req.tenant, priority=req.priority)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    try:
        async with client.stream("POST", target.url, json=target.body(req)) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                return RequestRecord.failed(req, f"HTTP {resp.status_code}: {detail}",
                                            start - t0)
            async for line in resp.aiter_lines():
                chunk = _parse_sse_line(line)
                if chunk is None:
                    continue
                if chunk == "[DONE]":
                    break
                now = clock()
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    reason = choice.get("finish_reason")
                    # A chunk with text, or without a finish reason (a token whose text is
                    # still incomplete UTF-8), carries a token; an empty closing chunk
                    # does not.
                    if choice.get("text") or reason is None:
                        metrics.token_times.append(now)
                    if reason:
                        finish_reason = reason
    except (httpx.HTTPError, StreamError, ValueError) as e:
        return RequestRecord.failed(req, f"{type(e).__name__}: {e}", start - t0)
    end = clock()
    times = metrics.token_times
    if usage and usage.get("completion_tokens") is not None:
        metrics.num_generation_tokens = int(usage["completion_tokens"])
    else:
        metrics.num_generation_tokens = len(times)
    if usage and usage.get("prompt_tokens"):
        metrics.num_prompt_tokens = int(usage["prompt_tokens"])
    if times:
        metrics.first_token_time, metrics.last_token_time = times[0], times[-1]
    metrics.finished_time = end
    metrics.finish_reason = finish_reason or "stop"
    return RequestRecord.from_metrics(req, metrics, t0)


def _parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """The JSON of one ``data:`` line, "[DONE]", or None for other lines (comments, events)."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[len("data:"):].strip()
    if data == "[DONE]":
        return data
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError as e:
        raise StreamError(f"bad JSON in stream: {data[:100]!r}") from e
    if not isinstance(chunk, dict):
        raise StreamError(f"unexpected stream chunk {data[:100]!r}")
    if "error" in chunk:
        raise StreamError(f"server error in stream: {chunk['error']}")
    return chunk
