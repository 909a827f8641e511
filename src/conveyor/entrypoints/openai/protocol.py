"""Pydantic models of the OpenAI API subset conveyor serves.

Requests are parsed strictly from JSON (``model_validate_json``): a string is not
a number, a float is not an integer. As vLLM's server does, a field conveyor does
not know (top-level or nested) is ignored, with one logged warning per field name
(``ignored_fields`` lists them), and a null means "the default". Fields clients
commonly send but conveyor does not implement are declared so that their default
(null, empty) passes and a value asking for what conveyor cannot do gets a clear
400 naming it from the serving code. The vLLM extras (``top_k``, ``min_p``, ...) and
conveyor's scheduling hints (``priority``, ``expected_output_tokens``,
``slo_ttft_ms``, ``slo_tpot_ms``) are accepted in the body.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer, model_validator

# Most sequences one request may ask for (n times the number of prompts is not capped).
MAX_N = 128


class _Request(BaseModel):
    # extra="allow": unknown fields land in ``model_extra``, reported by ``ignored_fields``.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the unknown fields in a parsed request (nested ones included), which
    are then dropped; chat messages and content parts keep their extras (the template's)."""
    names: list[str] = []
    if not isinstance(model, _Request):
        return names
    extra = model.model_extra or {}
    names.extend(prefix + key for key in extra)
    extra.clear()
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            names.extend(ignored_fields(value, f"{prefix}{name}."))
    return names


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- requests ------------------------------------------------------------------------------
class StreamOptions(_Request):
    include_usage: bool = False
    # vLLM's extension: usage (so far) in every chunk, when include_usage is set too.
    continuous_usage_stats: bool = False


class SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI's: token id (as a string) -> bias in [-100, 100] added to its logit.
    logit_bias: dict[str, float] | None = None
    # Accepted and ignored (OpenAI platform features that do not apply to a local server).
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM extras
    prompt_logprobs: int | None = None  # the prompt tokens' logprobs with this many top
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # conveyor scheduling hints (read by scheduling policies, never by the sampler)
    priority: int = 0
    expected_output_tokens: int | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    # prefill/decode disaggregation (vLLM's name): set by `conveyor router --prefill/--decode`
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's output constraints (entrypoints/openai/structured.py): json, regex, choice,
    # grammar, json_object; and the older guided_* fields.
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None  # not supported
    best_of: int | None = None  # only best_of == n (or null) is supported
    response_format: dict[str, Any] | None = None  # as chat's (vLLM takes it here too)


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Extra keys (tool_calls, tool_call_id, ...) are passed to the chat template as they are.
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Not supported (tool calling, structured output): must be null / empty / "text".
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


class TokenizeRequest(_Request):
    """vLLM's ``/tokenize``: a completion prompt, or chat messages through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Default: what /v1/completions does to a prompt (conveyor adds no special tokens;
    # chat templates write their own).
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---- responses -----------------------------------------------------------------------------
class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(_Response):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(_Response):
    """vLLM's layout of one scored prompt token or alternative."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's ``prompt_logprobs``: None for the first prompt token, then token id -> logprob.
PromptLogprobsField = list[dict[int, PromptLogprob] | None] | None


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsField = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)  # as vLLM: [] when none


class ChatCompletionChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobsField = None


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # (entrypoints/openai/tool_calls.py)


class ChatCompletionStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @field_serializer("delta")
    def _delta_without_nulls(self, delta: DeltaMessage) -> dict[str, Any]:
        # OpenAI sends the role once, then content alone: {"content": "..."}.
        return delta.model_dump(exclude_none=True)


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "conveyor"
    root: str | None = None
    parent: str | None = None  # an adapter's base model
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response):
    prompt: str


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo
