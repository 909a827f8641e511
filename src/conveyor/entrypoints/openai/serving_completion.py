"""``POST /v1/completions``: prompts (text, token ids, or lists of either) to text.

Each prompt is one engine request of ``n`` sequences; choice ``i * n + k`` is
sequence ``k`` of prompt ``i``, as in OpenAI's API.

``echo`` prepends the prompt's text. ``echo`` with ``logprobs`` would need the
prompt tokens' logprobs, which the model runner does not compute: that
combination is a 400 rather than a response that silently lacks them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from conveyor.engine.async_engine import RequestStream
from conveyor.engine.llm_engine import PromptType
from conveyor.entrypoints.openai.errors import OpenAIError, parse_body
from conveyor.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
)
from conveyor.entrypoints.openai.serving_common import (
    DONE,
    ClientDisconnected,
    ServerState,
    add_streams,
    build_sampling_params,
    check_model,
    check_not_aborted,
    check_prompt_size,
    clamp_logprob,
    final_outputs,
    kv_handle,
    make_usage,
    merge_streams,
    random_id,
    request_error,
    request_options,
    sse,
    sse_error,
    sse_response,
    token_text,
    until_disconnected,
    usage_options,
)
from conveyor.outputs import CompletionOutput, RequestOutput


async def create_completion(state: ServerState, raw_request: Request) -> Response:
    req = parse_body(CompletionRequest, await raw_request.body())
    check_model(state, req.model)
    _check_supported(req)
    params = build_sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs)
    prompts = prompt_list(req.prompt)
    for prompt in prompts:
        if isinstance(prompt, str):
            check_prompt_size(state, prompt, "prompt")
    request_id = random_id("cmpl")
    created = int(time.time())
    streams = await add_streams(state, prompts, params, request_id,
                                request_options(req, raw_request),
                                output_kind="delta" if req.stream else "final")
    if req.stream:
        return sse_response(_stream(state, req, request_id, created, streams))
    try:
        outputs = await until_disconnected(raw_request, final_outputs(streams))
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as e:  # timeout, engine fault: this request's error, as an HTTP status
        raise request_error(e) from None
    check_not_aborted(outputs)
    prompt_texts = await _echo_texts(state, req, outputs)
    body = _response(req, request_id, created, state.model_name, outputs,
                     prompt_texts).model_dump()
    handle = kv_handle(state, req, outputs)
    if handle is not None:
        body["kv_transfer_params"] = handle
    return JSONResponse(body)


def _check_supported(req: CompletionRequest) -> None:
    if req.echo and req.logprobs is not None:
        raise OpenAIError(400, "echo together with logprobs is not supported: conveyor does "
                               "not compute prompt logprobs; request them separately",
                          param="echo")
    if req.suffix:
        raise OpenAIError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise OpenAIError(400, f"best_of must equal n ({req.n}) or be null: conveyor does not "
                               "rank extra samples", param="best_of")


def prompt_list(prompt: str | list[str] | list[int] | list[list[int]]) -> list[PromptType]:
    """One engine prompt per entry: a string, a list of strings, token ids, or lists of ids."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError(400, "prompt must not be an empty list", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


async def _echo_texts(state: ServerState, req: CompletionRequest,
                      outputs: list[RequestOutput]) -> list[str]:
    if not req.echo:
        return [""] * len(outputs)
    texts = []
    for out in outputs:
        if out.prompt is not None:
            texts.append(out.prompt)
        else:  # token ids: decode them here, with the engine's tokenizer
            tokenizer = state.engine.info.tokenizer
            texts.append(tokenizer.decode(out.prompt_token_ids) if tokenizer else "")
    return texts


class _LogprobsBuilder:
    """Legacy completions logprobs; text offsets continue across streamed chunks."""

    def __init__(self, start_offset: int = 0) -> None:
        self.offset = start_offset

    def build(self, c: CompletionOutput) -> CompletionLogProbs:
        out = CompletionLogProbs()
        for token_id, entry in zip(c.token_ids, c.logprobs or []):
            sampled = entry[token_id]
            text = token_text(token_id, sampled)
            out.tokens.append(text)
            out.token_logprobs.append(clamp_logprob(sampled.logprob))
            out.top_logprobs.append({token_text(tid, lp): clamp_logprob(lp.logprob)
                                     for tid, lp in entry.items()})
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out


def _response(req: CompletionRequest, request_id: str, created: int, model: str,
              outputs: list[RequestOutput], prompt_texts: list[str]) -> CompletionResponse:
    choices = []
    completion_tokens = 0
    for i, out in enumerate(outputs):
        for c in out.outputs:
            logprobs = (_LogprobsBuilder().build(c) if req.logprobs is not None else None)
            choices.append(CompletionChoice(index=i * req.n + c.index,
                                            text=prompt_texts[i] + c.text, logprobs=logprobs,
                                            finish_reason=c.finish_reason,
                                            stop_reason=c.stop_reason))
            completion_tokens += len(c.token_ids)
    usage = make_usage(sum(len(o.prompt_token_ids) for o in outputs), completion_tokens,
                       sum(o.num_cached_tokens for o in outputs))
    return CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                              usage=usage)


async def _stream(state: ServerState, req: CompletionRequest, request_id: str, created: int,
                  streams: list[RequestStream]) -> AsyncIterator[str]:
    n = req.n
    num_choices = n * len(streams)
    finished = [False] * num_choices
    echoed = [not req.echo] * num_choices
    num_tokens = [0] * num_choices
    logprobs = [_LogprobsBuilder() for _ in range(num_choices)]
    prompt_tokens = [0] * len(streams)
    cached_tokens = [0] * len(streams)
    final_usage, continuous_usage = usage_options(req)
    try:
        async with contextlib.aclosing(merge_streams(streams)) as merged:
            async for i, out in merged:
                prompt_tokens[i] = len(out.prompt_token_ids)
                if out.finished:
                    cached_tokens[i] = out.num_cached_tokens
                for c in out.outputs:
                    index = i * n + c.index
                    text = c.text
                    if not echoed[index]:
                        text = (await _echo_texts(state, req, [out]))[0] + text
                        echoed[index] = True
                    num_tokens[index] += len(c.token_ids)
                    newly_finished = c.finish_reason is not None and not finished[index]
                    if not (text or c.token_ids or newly_finished):
                        continue
                    if newly_finished:
                        finished[index] = True
                        check_not_aborted([out])
                    choice = CompletionChoice(
                        index=index, text=text,
                        logprobs=logprobs[index].build(c) if req.logprobs is not None else None,
                        finish_reason=c.finish_reason if newly_finished else None,
                        stop_reason=c.stop_reason if newly_finished else None)
                    usage = (make_usage(sum(prompt_tokens), sum(num_tokens), sum(cached_tokens))
                             if continuous_usage else None)
                    chunk = CompletionChunk(id=request_id, created=created,
                                            model=state.model_name, choices=[choice],
                                            usage=usage)
                    yield sse(chunk.model_dump_json())
        if final_usage:
            usage = make_usage(sum(prompt_tokens), sum(num_tokens), sum(cached_tokens))
            chunk = CompletionChunk(id=request_id, created=created, model=state.model_name,
                                    choices=[], usage=usage)
            yield sse(chunk.model_dump_json())
    except Exception as e:  # this request alone fails; the stream ends with an error event
        yield sse_error(request_error(e))
    finally:
        for stream in streams:
            stream.close()  # also when the client went away before the first output
    yield DONE
