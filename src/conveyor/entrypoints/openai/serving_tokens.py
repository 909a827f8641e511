"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` (its benchmark client counts prompt
tokens with the first), with the same tokenizer and chat template the completions use."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse

from conveyor.entrypoints.openai.errors import OpenAIError, parse_body
from conveyor.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from conveyor.entrypoints.openai.serving_chat import render_prompt
from conveyor.entrypoints.openai.serving_common import ServerState, check_model, check_prompt_size


def _tokenizer(state: ServerState):
    tokenizer = state.engine.info.tokenizer
    if tokenizer is None:
        raise OpenAIError(400, "this model has no tokenizer")
    return tokenizer


async def tokenize(state: ServerState, raw_request: Request) -> JSONResponse:
    req = parse_body(TokenizeRequest, await raw_request.body())
    check_model(state, req.model)
    tokenizer = _tokenizer(state)
    if (req.prompt is None) == (req.messages is None):
        raise OpenAIError(400, "send exactly one of 'prompt' and 'messages'", param="prompt")
    if req.messages is not None:
        chat = ChatCompletionRequest(messages=req.messages,
                                     add_generation_prompt=req.add_generation_prompt,
                                     chat_template_kwargs=req.chat_template_kwargs)
        text, param = render_prompt(state, chat), "messages"
    else:
        text, param = req.prompt or "", "prompt"
    check_prompt_size(state, text, param)
    ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens) if text else []
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=state.max_model_len,
                                         tokens=ids, token_strs=strs).model_dump())


async def detokenize(state: ServerState, raw_request: Request) -> JSONResponse:
    req = parse_body(DetokenizeRequest, await raw_request.body())
    check_model(state, req.model)
    tokenizer = _tokenizer(state)
    vocab = state.engine.info.config.model.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise OpenAIError(400, f"tokens outside [0, {vocab}): {bad[:5]}", param="tokens")
    return JSONResponse(DetokenizeResponse(prompt=tokenizer.decode(req.tokens)).model_dump())
