"""``POST /v1/completions``: prompts (text, token ids, or lists of either) to text.

Each prompt is one engine request of ``n`` sequences; choice ``i * n + k`` is
sequence ``k`` of prompt ``i``, as in OpenAI's API.

``echo`` prepends the prompt's text; with ``logprobs`` the prompt's tokens come first
in ``logprobs`` too (the first one's logprob and alternatives null), as OpenAI lays them
out, and ``max_tokens`` 0 returns the prompt alone (what loglikelihood evaluations send).
vLLM's ``prompt_logprobs`` field returns them in its own layout on each choice.
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
    answer_model,
    build_sampling_params,
    check_model,
    check_not_aborted,
    check_prompt_size,
    clamp_logprob,
    final_outputs,
    kv_handle,
    make_usage,
    merge_streams,
    prompt_logprobs_field,
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
    lora = check_model(state, req.model)  # the adapter the model names, if one
    _check_supported(req)
    # max_tokens 0 with echo: the prompt alone; one token is generated and not shown.
    params = build_sampling_params(req, max_tokens=1 if _prompt_only(req) else req.max_tokens,
                                   logprobs=req.logprobs,
                                   prompt_logprobs=req.logprobs if req.echo else None)
    prompts = prompt_list(req.prompt)
    for prompt in prompts:
        if isinstance(prompt, str):
            check_prompt_size(state, prompt, "prompt")
    request_id = random_id("cmpl")
    created = int(time.time())
    streams = await add_streams(state, prompts, params, request_id,
                                request_options(req, raw_request) | {"lora_request": lora},
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
    body = _response(req, request_id, created, answer_model(state, req), outputs,
                     prompt_texts, _first_texts(state, req, outputs)).model_dump()
    handle = kv_handle(state, req, outputs)
    if handle is not None:
        body["kv_transfer_params"] = handle
    return JSONResponse(body)


def _prompt_only(req: CompletionRequest) -> bool:
    return req.echo and req.max_tokens == 0


def _check_supported(req: CompletionRequest) -> None:
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


def _first_texts(state: ServerState, req: CompletionRequest,
                 outputs: list[RequestOutput]) -> list[str]:
    """Each prompt's first token as text (echo with logprobs lists it, unscored)."""
    if not (req.echo and req.logprobs is not None):
        return [""] * len(outputs)
    tokenizer = state.engine.info.tokenizer
    return [tokenizer.decode([o.prompt_token_ids[0]], skip_special_tokens=False) if tokenizer
            else f"token_id:{o.prompt_token_ids[0]}" for o in outputs]


def _shown(c: CompletionOutput, prompt_only: bool) -> CompletionOutput:
    """What a choice shows of a sample: nothing generated when only the prompt was asked."""
    if not prompt_only:
        return c
    return CompletionOutput(c.index, "", [], None, [] if c.logprobs is not None else None,
                            "length" if c.finish_reason is not None else None)


class _LogprobsBuilder:
    """Legacy completions logprobs; text offsets continue across streamed chunks."""

    def __init__(self, start_offset: int = 0) -> None:
        self.offset = start_offset

    def prompt(self, out: RequestOutput, first_text: str, k: int) -> CompletionLogProbs:
        """The echoed prompt's tokens: the first unscored, then each with its logprob and
        top ``k`` alternatives (null where the engine did not compute them)."""
        lps = CompletionLogProbs()
        scored = out.prompt_logprobs or []
        for i, token_id in enumerate(out.prompt_token_ids):
            entry = scored[i] if i < len(scored) else None
            if entry is None:
                text = first_text if i == 0 else f"token_id:{token_id}"
                lps.token_logprobs.append(None)
                lps.top_logprobs.append(None)
            else:
                text = token_text(token_id, entry[token_id])
                lps.token_logprobs.append(clamp_logprob(entry[token_id].logprob))
                lps.top_logprobs.append({token_text(tid, lp): clamp_logprob(lp.logprob)
                                         for tid, lp in entry.items()
                                         if tid == token_id or (lp.rank or 0) <= k})
            lps.tokens.append(text)
            lps.text_offset.append(self.offset)
            self.offset += len(text)
        return lps

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


def _choice_logprobs(req: CompletionRequest, builder: _LogprobsBuilder, out: RequestOutput,
                     c: CompletionOutput, first_text: str | None) -> CompletionLogProbs | None:
    """``first_text`` set: the echoed prompt's entries come first."""
    if req.logprobs is None:
        return None
    if first_text is None:
        return builder.build(c)
    lps = builder.prompt(out, first_text, req.logprobs)
    generated = builder.build(c)
    lps.tokens += generated.tokens
    lps.token_logprobs += generated.token_logprobs
    lps.top_logprobs += generated.top_logprobs
    lps.text_offset += generated.text_offset
    return lps


def _response(req: CompletionRequest, request_id: str, created: int, model: str,
              outputs: list[RequestOutput], prompt_texts: list[str],
              first_texts: list[str]) -> CompletionResponse:
    choices = []
    completion_tokens = 0
    for i, out in enumerate(outputs):
        prompt_logprobs = (prompt_logprobs_field(out, req.prompt_logprobs)
                           if req.prompt_logprobs is not None else None)
        for c in out.outputs:
            c = _shown(c, _prompt_only(req))
            logprobs = _choice_logprobs(req, _LogprobsBuilder(), out, c,
                                        first_texts[i] if req.echo else None)
            choices.append(CompletionChoice(index=i * req.n + c.index,
                                            text=prompt_texts[i] + c.text, logprobs=logprobs,
                                            finish_reason=c.finish_reason,
                                            stop_reason=c.stop_reason,
                                            prompt_logprobs=prompt_logprobs))
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
    prompts: list[RequestOutput | None] = [None] * len(streams)
    cached_tokens = [0] * len(streams)
    final_usage, continuous_usage = usage_options(req)
    try:
        async with contextlib.aclosing(merge_streams(streams)) as merged:
            async for i, out in merged:
                prompt_tokens[i] = len(out.prompt_token_ids)
                if out.finished:
                    cached_tokens[i] = out.num_cached_tokens
                if out.prompt_logprobs is not None:
                    prompts[i] = out  # a stream carries the prompt's logprobs once
                for c in out.outputs:
                    index = i * n + c.index
                    c = _shown(c, _prompt_only(req))
                    text = c.text
                    first_text = None
                    if not echoed[index]:
                        text = (await _echo_texts(state, req, [out]))[0] + text
                        first_text = _first_texts(state, req, [out])[0]
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
                        logprobs=_choice_logprobs(req, logprobs[index], prompts[i] or out, c,
                                                  first_text),
                        finish_reason=c.finish_reason if newly_finished else None,
                        stop_reason=c.stop_reason if newly_finished else None)
                    usage = (make_usage(sum(prompt_tokens), sum(num_tokens), sum(cached_tokens))
                             if continuous_usage else None)
                    chunk = CompletionChunk(id=request_id, created=created,
                                            model=answer_model(state, req), choices=[choice],
                                            usage=usage)
                    yield sse(chunk.model_dump_json())
        if final_usage:
            usage = make_usage(sum(prompt_tokens), sum(num_tokens), sum(cached_tokens))
            chunk = CompletionChunk(id=request_id, created=created, model=answer_model(state, req),
                                    choices=[], usage=usage)
            yield sse(chunk.model_dump_json())
    except Exception as e:  # this request alone fails; the stream ends with an error event
        yield sse_error(request_error(e))
    finally:
        for stream in streams:
            stream.close()  # also when the client went away before the first output
    yield DONE
