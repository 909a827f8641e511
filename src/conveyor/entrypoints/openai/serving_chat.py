"""``POST /v1/chat/completions``: messages rendered with the checkpoint's chat template.

The rendered text is tokenized as is (no extra BOS): templates write their own
special tokens, as in vLLM. Streams open with a role chunk per choice, then
content deltas; the chunk that ends a choice carries its ``finish_reason``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from conveyor.engine.async_engine import RequestStream
from conveyor.entrypoints.openai.chat_template import ChatTemplateError
from conveyor.entrypoints.openai.errors import OpenAIError, from_engine_error, parse_body
from conveyor.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaMessage,
)
from conveyor.entrypoints.openai.reasoning import (
    ReasoningStream,
    prompt_thinking,
    split_reasoning,
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
from conveyor.entrypoints.openai.tool_calls import (
    ToolCallStream,
    ToolPlan,
    finish_reason,
    plan_tools,
)
from conveyor.outputs import CompletionOutput, RequestOutput
from conveyor.sampling_params import SamplingParams

MAX_TOP_LOGPROBS = 20


async def create_chat_completion(state: ServerState, raw_request: Request) -> Response:
    req = parse_body(ChatCompletionRequest, await raw_request.body())
    lora = check_model(state, req.model)  # the adapter the model names, if one
    _check_supported(req)
    tools = plan_tools(req, state.tool_call_parser, state.enable_auto_tool_choice)
    prompt = render_prompt(state, req, tools)
    check_prompt_size(state, prompt, "messages")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = build_sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)
    if tools is not None and tools.structured is not None:
        if params.structured_outputs is not None:
            raise OpenAIError(400, f"tool_choice {tools.mode!r} constrains the output: it "
                                   "cannot be combined with response_format or "
                                   "structured_outputs", param="tool_choice")
        params = _with_constraint(params, tools)
    reasoner = state.reasoning_parser
    thinking = prompt_thinking(prompt) if reasoner is not None else "closed"
    if thinking == "closed":
        reasoner = None  # the template closed the block: the output is all content
    elif params.structured_outputs is not None:
        # A thinking model thinks first: the constraint applies to the answer after
        # </think> (structured_outputs.py, after_reasoning); qwen3 may skip the block.
        params = _after_reasoning(params, optional=reasoner == "qwen3" and thinking == "none")
    request_id = random_id("chatcmpl")
    created = int(time.time())
    streams = await add_streams(state, [prompt], params, request_id,
                                request_options(req, raw_request) | {"lora_request": lora},
                                output_kind="delta" if req.stream else "final",
                                prompt_param="messages")
    if req.stream:
        return sse_response(_stream(state, req, request_id, created, streams[0], tools,
                                    reasoner))
    try:
        outputs = await until_disconnected(raw_request, final_outputs(streams))
    except ClientDisconnected:
        return Response(status_code=499)
    except Exception as e:  # timeout, engine fault: this request's error, as an HTTP status
        raise request_error(e) from None
    check_not_aborted(outputs)
    body = _response(req, request_id, created, answer_model(state, req), outputs[0],
                     tools, reasoner).model_dump()
    handle = kv_handle(state, req, outputs)
    if handle is not None:
        body["kv_transfer_params"] = handle
    return JSONResponse(body)


def _check_supported(req: ChatCompletionRequest) -> None:
    # Tools: entrypoints/openai/tool_calls.py. The legacy functions are accepted when the
    # client turns calling them off (function_call "none"): left out of the prompt.
    for tools, choice in (("functions", "function_call"),):
        chosen = getattr(req, choice)
        if chosen not in (None, "none", "auto"):
            raise OpenAIError(400, f"{choice}={chosen!r} (tool calling) is not supported; "
                                   f"send {choice} 'none'", param=choice)
        if getattr(req, tools) and chosen != "none":
            raise OpenAIError(400, f"{tools} with {choice} {chosen or 'auto'!r} (tool calling) "
                                   f"is not supported: conveyor has no tool-call parser; send "
                                   f"{choice} 'none' to have them ignored", param=tools)
    for i, m in enumerate(req.messages):
        if m.content is None and not (m.role == "assistant" and _calls_a_tool(m)):
            raise OpenAIError(400, f"messages[{i}]: a {m.role} message needs 'content'",
                              param=f"messages[{i}].content")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs set to true",
                              param="top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise OpenAIError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                                   f"{req.top_logprobs}", param="top_logprobs")


def _calls_a_tool(m: ChatMessage) -> bool:
    extra = m.model_extra or {}
    return bool(extra.get("tool_calls") or extra.get("function_call"))


def _with_constraint(params: SamplingParams, tools: ToolPlan) -> SamplingParams:
    try:  # validated again: ignore_eos or min_tokens cannot go with a grammar
        return dataclasses.replace(params, structured_outputs=tools.structured)
    except ValueError as e:
        raise from_engine_error(e) from None


def _after_reasoning(params: SamplingParams, optional: bool) -> SamplingParams:
    constraint = dataclasses.replace(params.structured_outputs, after_reasoning=True,
                                     reasoning_optional=optional)
    try:
        constraint.grammar_text()
    except ValueError as e:
        raise OpenAIError(400, str(e), param="structured_outputs") from None
    return dataclasses.replace(params, structured_outputs=constraint)


def render_prompt(state: ServerState, req: ChatCompletionRequest,
                  tools: ToolPlan | None = None) -> str:
    if state.chat_template is None:
        raise OpenAIError(400, "this model has no chat template (none in its tokenizer files); "
                               "start the server with --chat-template, or use /v1/completions",
                          param="messages")
    messages = [_message_dict(i, m) for i, m in enumerate(req.messages)]
    try:
        kwargs = dict(req.chat_template_kwargs or {})
        if tools is not None:
            kwargs["tools"] = tools.tools  # the template renders them (tool_choice none: not)
        return state.chat_template.render(messages, req.add_generation_prompt, **kwargs)
    except ChatTemplateError as e:
        raise OpenAIError(400, f"the chat template rejected the messages: {e}",
                          param="messages") from None


def _message_dict(i: int, message: ChatMessage) -> dict[str, Any]:
    """A plain dict for the template; text parts are joined, other parts are refused."""
    out = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise OpenAIError(400, f"messages[{i}]: content part of type {part.type!r} is "
                                       "not supported (text only)", param="messages")
            texts.append(part.text)
        content = "\n".join(texts)
    out["content"] = content or ""
    return out


def _logprobs(c: CompletionOutput, top_n: int) -> ChatChoiceLogprobs:
    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs or []):
        sampled = entry[token_id]
        text = token_text(token_id, sampled)
        # The entry holds the top-k (ranks 1..k) plus the sampled token at its own rank.
        top = sorted(((tid, lp) for tid, lp in entry.items()
                      if lp.rank is not None and lp.rank <= top_n), key=lambda x: x[1].rank)
        content.append(ChatTokenLogprob(
            token=text, logprob=clamp_logprob(sampled.logprob), bytes=list(text.encode()),
            top_logprobs=[ChatTopLogprob(token=token_text(tid, lp),
                                         logprob=clamp_logprob(lp.logprob),
                                         bytes=list(token_text(tid, lp).encode()))
                          for tid, lp in top[:top_n]]))
    return ChatChoiceLogprobs(content=content)


def _response(req: ChatCompletionRequest, request_id: str, created: int, model: str,
              out: RequestOutput, tools: ToolPlan | None = None,
              reasoner: str | None = None) -> ChatCompletionResponse:
    choices = []
    for c in out.outputs:
        text, extra = c.text, {}
        if reasoner is not None:  # --reasoning-parser: the thinking apart
            reasoning, text = split_reasoning(reasoner, c.text, final=True)
            extra["reasoning_content"] = reasoning or None
        message, reason = ChatResponseMessage(content=text, **extra), c.finish_reason
        if tools is not None:
            calls = ToolCallStream(tools)
            content, tool_calls = calls.message(text)
            message = ChatResponseMessage(content=content, tool_calls=tool_calls, **extra)
            reason = finish_reason(reason, bool(tool_calls))
        choices.append(ChatCompletionChoice(
            index=c.index, message=message,
            logprobs=_logprobs(c, req.top_logprobs or 0) if req.logprobs else None,
            finish_reason=reason, stop_reason=c.stop_reason))
    usage = make_usage(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs),
                       out.num_cached_tokens)
    return ChatCompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                  usage=usage,
                                  prompt_logprobs=prompt_logprobs_field(out, req.prompt_logprobs)
                                  if req.prompt_logprobs is not None else None)


async def _stream(state: ServerState, req: ChatCompletionRequest, request_id: str, created: int,
                  stream: RequestStream, tools: ToolPlan | None = None,
                  reasoner: str | None = None) -> AsyncIterator[str]:
    def chunk(choices: list[ChatCompletionStreamChoice], **kw: Any) -> str:
        return sse(ChatCompletionChunk(id=request_id, created=created,
                                       model=answer_model(state, req),
                                       choices=choices, **kw).model_dump_json())

    finished = [False] * req.n
    num_tokens = [0] * req.n
    # With tools: each choice's text so far, re-parsed for its content and call deltas.
    calls = [ToolCallStream(tools) for _ in range(req.n)] if tools is not None else None
    texts = [""] * req.n
    # With a reasoning parser: the reasoning deltas apart, the content after them.
    thinking = ([ReasoningStream(reasoner) for _ in range(req.n)]
                if reasoner is not None else None)
    content_sent = [0] * req.n
    prompt_tokens = cached_tokens = 0
    final_usage, continuous_usage = usage_options(req)

    def usage_so_far() -> dict[str, Any]:
        if not continuous_usage:
            return {}
        return {"usage": make_usage(prompt_tokens, sum(num_tokens), cached_tokens)}

    def role_chunks() -> list[str]:
        return [chunk([ChatCompletionStreamChoice(
            index=k, delta=DeltaMessage(role="assistant", content=""))], **usage_so_far())
            for k in range(req.n)]

    try:
        # With usage in every chunk the role chunks wait for the first output, which
        # carries the prompt's length (the engine tokenizes); otherwise they go at once.
        roles_sent = not continuous_usage
        if roles_sent:
            for text in role_chunks():
                yield text
        async with contextlib.aclosing(merge_streams([stream])) as merged:
            async for _, out in merged:
                prompt_tokens = len(out.prompt_token_ids)
                cached_tokens = out.num_cached_tokens
                if not roles_sent:
                    roles_sent = True
                    for text in role_chunks():
                        yield text
                for c in out.outputs:
                    num_tokens[c.index] += len(c.token_ids)
                    newly_finished = c.finish_reason is not None and not finished[c.index]
                    if not (c.text or c.token_ids or newly_finished):
                        continue
                    if newly_finished:
                        finished[c.index] = True
                        check_not_aborted([out])
                    delta, reason = DeltaMessage(content=c.text), c.finish_reason
                    if calls is not None or thinking is not None:
                        i = c.index
                        texts[i] += c.text
                        thought, answer = (thinking[i].update(texts[i], newly_finished)
                                           if thinking is not None else ("", texts[i]))
                        if calls is not None:
                            content, tool_deltas = calls[i].update(answer, newly_finished)
                            reason = finish_reason(reason, calls[i].made_calls)
                        else:
                            content, tool_deltas = answer[content_sent[i]:], []
                            content_sent[i] = max(content_sent[i], len(answer))
                        if not (thought or content or tool_deltas or newly_finished):
                            continue  # held back: maybe the start of a tag or a call
                        extra = {"reasoning_content": thought} if thought else {}
                        delta = DeltaMessage(content=content or None,
                                             tool_calls=tool_deltas or None, **extra)
                    yield chunk([ChatCompletionStreamChoice(
                        index=c.index, delta=delta,
                        logprobs=_logprobs(c, req.top_logprobs or 0) if req.logprobs else None,
                        finish_reason=reason if newly_finished else None,
                        stop_reason=c.stop_reason if newly_finished else None)],
                        **usage_so_far())
        if final_usage:
            yield chunk([], usage=make_usage(prompt_tokens, sum(num_tokens), cached_tokens))
    except Exception as e:  # this request alone fails; the stream ends with an error event
        yield sse_error(request_error(e))
    finally:
        stream.close()  # also when the client went away before the first output
    yield DONE
