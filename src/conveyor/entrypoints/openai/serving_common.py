"""What completions and chat completions share: request fields to engine arguments,
adding and merging request streams, client disconnects, SSE framing, usage, logprobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from conveyor.config.lora import LoRARequest
from conveyor.core.grammar_gate import GRAMMAR_FAILED
from conveyor.core.kv_connector import KV_TRANSFER_FAILED
from conveyor.core.lora_loads import LORA_LOAD_FAILED
from conveyor.engine.async_engine import AsyncEngine, RequestStream
from conveyor.engine.llm_engine import PromptType
from conveyor.entrypoints.openai.chat_template import ChatTemplate
from conveyor.entrypoints.openai.errors import OpenAIError, from_engine_error
from conveyor.entrypoints.openai.protocol import (
    PromptLogprob,
    PromptTokensDetails,
    SamplingRequest,
    UsageInfo,
)
from conveyor.entrypoints.openai.serving_lora import LoRARegistry
from conveyor.entrypoints.openai.structured import structured_outputs_of
from conveyor.kv_transfer.messages import KVTransferParams
from conveyor.metrics import EngineMetrics
from conveyor.outputs import Logprob, RequestOutput
from conveyor.sampling_params import SamplingParams

T = TypeVar("T")
logger = logging.getLogger("conveyor.server")

# OpenAI clients choke on -inf; vLLM reports impossible tokens with this floor too.
_MIN_LOGPROB = -9999.0
DONE = "data: [DONE]\n\n"


# 8 MiB: a prompt of well over a million tokens as text or as a JSON list of ids.
DEFAULT_MAX_BODY_BYTES = 8 << 20


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    model_root: str
    max_model_len: int
    metrics: EngineMetrics
    chat_template: ChatTemplate | None = None
    request_timeout_s: float | None = None
    api_key: str | None = None
    # A text prompt longer than this (UTF-8 bytes) cannot fit in max_model_len tokens,
    # whatever it says: refused before tokenizing it (None: no such bound is known).
    max_prompt_bytes: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # Multi-LoRA: the adapters a request's model may name (None: LoRA off).
    loras: LoRARegistry | None = None
    # Tool calling (entrypoints/openai/tool_calls.py): --tool-call-parser, and whether
    # tool_choice "auto" is served (--enable-auto-tool-choice).
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # --reasoning-parser (entrypoints/openai/reasoning.py): <think> as reasoning_content.
    reasoning_parser: str | None = None


def max_token_bytes(tokenizer: Any) -> int | None:
    """An upper bound on the UTF-8 bytes of text one token covers, from the vocabulary.

    A vocabulary entry's own spelling is at least as long in UTF-8 as the text it stands
    for: byte-level BPE spells each byte as one character, SentencePiece a space as the
    3-byte "▁", WordPiece adds "##"."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary to read: no bound
        return None
    return max((len(t.encode()) for t in vocab), default=0) or None


def prompt_byte_cap(tokenizer: Any, max_model_len: int) -> int | None:
    """Bytes beyond which a text prompt surely tokenizes to max_model_len tokens or more;
    twice the strict bound, for normalizers that shorten text (NFC composes characters)."""
    per_token = max_token_bytes(tokenizer) if tokenizer is not None else None
    return None if per_token is None else 2 * max_model_len * per_token


def check_prompt_size(state: ServerState, text: str, param: str) -> None:
    """400 at once for a text that cannot fit, before spending CPU on tokenizing it."""
    cap = state.max_prompt_bytes
    if cap is None or len(text) * 4 <= cap:  # (4: most UTF-8 bytes a character takes)
        return
    size = len(text.encode())
    if size > cap:
        raise OpenAIError(400, f"{param} is {size} bytes of text, which is more than "
                               f"max_model_len ({state.max_model_len}) tokens of this "
                               "tokenizer can hold", param=param)


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(state: ServerState, name: str | None) -> LoRARequest | None:
    """404 unless ``name`` is the served model or a loaded adapter; the adapter, if one."""
    if state.loras is not None and name in state.loras.adapters:
        return state.loras.adapters[name]
    if name is not None and name != state.model_name:
        raise OpenAIError(404, f"the model {name!r} does not exist; this server serves "
                               f"{state.model_name!r}", param="model", code="model_not_found")


# ---- request fields -> engine arguments ------------------------------------------------------
def build_sampling_params(req: SamplingRequest, max_tokens: int | None,
                          logprobs: int | None, prompt_logprobs: int | None = None
                          ) -> SamplingParams:
    """``prompt_logprobs``: what the endpoint asks for beyond the request's own field (a
    completion's ``echo`` with ``logprobs``); the larger of the two is computed."""
    if req.prompt_logprobs is not None and req.stream:
        raise OpenAIError(400, "prompt_logprobs is not available when stream is true",
                          param="prompt_logprobs")
    asked = [k for k in (req.prompt_logprobs, prompt_logprobs) if k is not None]
    if req.stream_options is not None and not req.stream:
        raise OpenAIError(400, "stream_options is only allowed when stream is true",
                          param="stream_options")
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        value = getattr(req, name)
        if value is not None and value <= 0:
            raise OpenAIError(400, f"{name} must be > 0, got {value}", param=name)
    kwargs: dict[str, Any] = dict(
        n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens, seed=req.seed,
        stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens, logprobs=logprobs,
        prompt_logprobs=max(asked) if asked else None, logit_bias=parse_logit_bias(req),
        expected_output_tokens=req.expected_output_tokens,
        structured_outputs=structured_outputs_of(req))
    optional = dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                    min_p=req.min_p, presence_penalty=req.presence_penalty,
                    frequency_penalty=req.frequency_penalty,
                    repetition_penalty=req.repetition_penalty)
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise from_engine_error(e) from None


def parse_logit_bias(req: SamplingRequest) -> dict[int, float] | None:
    """OpenAI's string keys as token ids; a key that is no token id is a 400."""
    if not req.logit_bias:
        return None
    bias: dict[int, float] = {}
    for key, value in req.logit_bias.items():
        if not key.strip().isdigit():
            raise OpenAIError(400, f"logit_bias keys must be token ids, got {key!r}",
                              param="logit_bias")
        bias[int(key)] = value
    return bias


def prompt_logprobs_field(out: RequestOutput, k: int) -> list | None:
    """vLLM's ``prompt_logprobs`` of a request output, the top ``k`` and each prompt token
    (None when not computed; an endpoint may have computed more alternatives)."""
    if out.prompt_logprobs is None:
        return None
    # An entry holds the top alternatives in rank order, then the token where it is not
    # among them.
    return [None if entry is None else
            {tid: PromptLogprob(logprob=clamp_logprob(lp.logprob), rank=lp.rank,
                                decoded_token=lp.decoded_token)
             for n, (tid, lp) in enumerate(entry.items()) if n < k or tid == token}
            for entry, token in zip(out.prompt_logprobs, out.prompt_token_ids)]


def request_options(req: SamplingRequest, raw_request: Request) -> dict[str, Any]:
    """Scheduling hints: a gateway's ``X-Tenant`` header wins over the body's ``user``;
    and the request's part in a KV transfer (prefill/decode disaggregation)."""
    tenant = raw_request.headers.get("x-tenant") or req.user
    return dict(priority=req.priority, tenant=tenant, slo_ttft_ms=req.slo_ttft_ms,
                slo_tpot_ms=req.slo_tpot_ms, kv_transfer_params=kv_transfer_params(req))


def kv_transfer_params(req: SamplingRequest) -> KVTransferParams | None:
    """The body's ``kv_transfer_params``, typed and checked (400 when malformed)."""
    if req.kv_transfer_params is None:
        return None
    try:
        params = msgspec.convert(req.kv_transfer_params, KVTransferParams)
        params.check()
    except (msgspec.ValidationError, ValueError) as e:
        raise OpenAIError(400, f"kv_transfer_params: {e}", param="kv_transfer_params") from None
    if params.do_remote_decode and req.stream:
        raise OpenAIError(400, "kv_transfer_params with do_remote_decode (a prefill request) "
                               "cannot stream: its response carries the handle",
                          param="kv_transfer_params")
    if params.do_remote_prefill and params.model is not None and params.model != req.model:
        raise OpenAIError(400, f"kv_transfer_params: the prompt's K/V was computed with model "
                               f"{params.model!r} (an adapter's K/V differs from the base "
                               f"model's and another adapter's), this request names "
                               f"{req.model!r}", param="kv_transfer_params")
    return params


def kv_handle(state: ServerState, req: SamplingRequest,
              outputs: list[RequestOutput]) -> dict[str, Any] | None:
    """A prefill engine's response carries the handle a decode engine pulls with: the
    transfer id, where this engine's KV server listens, the prompt's length."""
    params = kv_transfer_params(req)
    if params is None or not params.do_remote_decode:
        return None
    cfg = state.engine.info.config.kv_transfer
    return {"transfer_id": params.transfer_id, "do_remote_prefill": True,
            "remote_host": cfg.host, "remote_port": cfg.port,
            "num_prompt_tokens": len(outputs[0].prompt_token_ids), "model": req.model}


async def add_streams(state: ServerState, prompts: list[PromptType], params: SamplingParams,
                      request_id: str, options: dict[str, Any], output_kind: str,
                      prompt_param: str = "prompt") -> list[RequestStream]:
    """Queue one engine request per prompt; all or none (a failure aborts the others)."""
    streams: list[RequestStream] = []
    i = 0
    try:
        for i, prompt in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(await state.engine.add_request(
                rid, prompt, params, output_kind=output_kind,
                timeout_s=state.request_timeout_s, **options))
    except Exception as e:
        for stream in streams:
            stream.close()
        err = request_error(e)
        if err.param == "prompt":
            err.param = prompt_param
        if err.status == 400 and len(prompts) > 1:
            err.message = f"prompt {i}: {err.message}"
        raise err from None
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    return streams


# ---- streams -----------------------------------------------------------------------------
async def merge_streams(streams: list[RequestStream]
                        ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams as they come; closes them all at the end."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    items: asyncio.Queue[tuple[int, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                items.put_nowait((i, out))
            items.put_nowait((i, None))
        except Exception as e:
            items.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await items.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    last: list[RequestOutput | None] = [None] * len(streams)
    async with contextlib.aclosing(merge_streams(streams)) as merged:
        async for i, out in merged:
            last[i] = out
    assert all(o is not None and o.finished for o in last)
    return last  # type: ignore[return-value]


async def until_disconnected(raw_request: Request, work: Awaitable[T]) -> T:
    """Run ``work`` unless the client disconnects first (then cancel it: its streams abort)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


def request_error(e: BaseException) -> OpenAIError:
    """The HTTP error for what failed one request; unexpected ones are logged with traceback."""
    err = from_engine_error(e)
    if err.status >= 500 and not isinstance(e, OpenAIError):
        logger.error("request failed: %s", err.message, exc_info=e)
    return err


def check_not_aborted(outputs: list[RequestOutput]) -> None:
    """An output the server did not abort but the engine did (e.g. queue-wait rejection)."""
    for out in outputs:
        if any(c.finish_reason == "abort" and c.stop_reason == "slo_unattainable"
               for c in out.outputs):
            # --slo-late-action reject: refused before it ran, as a full queue is.
            raise OpenAIError(429, "the request's TTFT target can no longer be met at the "
                                   "current load (--scheduling-policy slo, --slo-late-action "
                                   "reject); retry later or with a looser slo_ttft_ms",
                              code="slo_unattainable")
        failed = [c.stop_reason for c in out.outputs if c.finish_reason == "abort"
                  and isinstance(c.stop_reason, str)
                  and c.stop_reason.startswith(KV_TRANSFER_FAILED)]
        if failed:
            # --kv-transfer-fallback fail: the prompt's K/V never arrived from the prefill.
            raise OpenAIError(502, f"the KV transfer from the prefill engine failed "
                                   f"({failed[0].split(': ', 1)[-1]}); this decode engine "
                                   f"runs --kv-transfer-fallback fail", code=KV_TRANSFER_FAILED)
        lora_failed = [c.stop_reason for c in out.outputs if c.finish_reason == "abort"
                       and isinstance(c.stop_reason, str)
                       and c.stop_reason.startswith(LORA_LOAD_FAILED)]
        if lora_failed:  # the adapter's files passed the checks but could not be loaded
            raise OpenAIError(400, f"the adapter could not be loaded "
                                   f"({lora_failed[0].split(': ', 1)[-1]})",
                              code=LORA_LOAD_FAILED)
        failed = [c.stop_reason for c in out.outputs if c.finish_reason == "abort"
                  and isinstance(c.stop_reason, str) and c.stop_reason.startswith(GRAMMAR_FAILED)]
        if failed:
            # The constraint passed the front end's check but the grammar engine's compile
            # refused it: the request's own input, so a 400 with the engine's reason.
            raise OpenAIError(400, f"the constraint could not be compiled: "
                                   f"{failed[0].split(': ', 1)[-1]}", code=GRAMMAR_FAILED)
        if any(c.finish_reason == "abort" for c in out.outputs):
            raise OpenAIError(503, "the engine aborted the request before it completed (it may "
                                   "have waited in the queue past --max-queue-wait-s)",
                              code="aborted")


# ---- SSE ---------------------------------------------------------------------------------
def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def sse_error(err: OpenAIError) -> str:
    return sse(json.dumps(err.body()))


class SSEResponse(StreamingResponse):
    """Closes the body generator as soon as the response ends, so that a client that went
    away while a chunk was being sent aborts its request now, not when garbage collected."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()


def sse_response(body: AsyncIterator[str]) -> SSEResponse:
    return SSEResponse(body, media_type="text/event-stream",
                       headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# ---- usage and logprobs --------------------------------------------------------------------
def usage_options(req: SamplingRequest) -> tuple[bool, bool]:
    """(usage in a last chunk, usage so far in every chunk): vLLM's continuous_usage_stats
    counts only together with include_usage."""
    opts = req.stream_options
    if opts is None or not opts.include_usage:
        return False, False
    return True, opts.continuous_usage_stats


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


def clamp_logprob(value: float) -> float:
    return value if value >= _MIN_LOGPROB and not math.isnan(value) else _MIN_LOGPROB


def token_text(token_id: int, logprob: Logprob) -> str:
    """The token's text; ``token_id:N`` when the model has no tokenizer (as vLLM does)."""
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"


def answer_model(state: ServerState, req: SamplingRequest) -> str:
    """The model a response names: the adapter the request named, else the served model."""
    if state.loras is not None and req.model in state.loras.adapters:
        return req.model
    return state.model_name
