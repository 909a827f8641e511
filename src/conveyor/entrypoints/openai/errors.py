"""OpenAI-style errors: one exception type, mapped from engine and validation errors.

Every error body looks like OpenAI's::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": null}}
"""

from __future__ import annotations

import logging
import threading
from http import HTTPStatus
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from conveyor.engine.async_engine import (
    EngineDeadError,
    EngineStepError,
    QueueFullError,
    RequestTimeoutError,
)
from conveyor.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    ignored_fields,
)

logger = logging.getLogger("conveyor.server")

M = TypeVar("M", bound=BaseModel)
_FIELDS = frozenset(CompletionRequest.model_fields) | frozenset(ChatCompletionRequest.model_fields)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, err_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = err_type or _TYPES.get(status) or HTTPStatus(status).phrase

    def body(self) -> dict:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info).model_dump()


class _WarnOnce:
    """Logs each ignored field name once per process, not once per request."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, route: str, names: list[str]) -> None:
        for name in names:
            key = f"{route}:{name}"
            with self._lock:
                if key in self._seen:
                    continue
                self._seen.add(key)
            logger.warning("%s: ignoring the unrecognized request field %r (logged once)",
                           route, name)


warn_ignored = _WarnOnce()


def parse_body(model: type[M], body: bytes) -> M:
    """Validate a JSON body strictly; a 400 naming the first offending field otherwise.
    Unknown fields are dropped with one warning per name."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        raise validation_error(e) from None
    names = ignored_fields(req)
    if names:
        warn_ignored(model.__name__, names)
    return req


def validation_error(e: ValidationError) -> OpenAIError:
    errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return OpenAIError(400, f"the body is not valid JSON: {first['msg']}")
    if not first["loc"]:
        return OpenAIError(400, f"the body must be a JSON object: {first['msg']}")
    field = str(first["loc"][0])
    if first["type"] == "extra_forbidden":
        where = field + _where(first["loc"][1:])
        return OpenAIError(400, f"unrecognized request argument: {where!r}", param=field)
    same = [err for err in errors if err["loc"] and str(err["loc"][0]) == field]
    # A union field (``prompt``, ``stop``) fails once per alternative: name the alternatives.
    tags = list(dict.fromkeys(str(err["loc"][1]) for err in same
                              if len(err["loc"]) > 1 and _is_union_tag(err["loc"][1])))
    if len(tags) > 1:
        return OpenAIError(400, f"invalid {field!r}: expected one of {', '.join(tags)}",
                           param=field)
    details = "; ".join(dict.fromkeys(_describe(err) for err in same))
    return OpenAIError(400, f"invalid {field!r}: {details}", param=field)


def _is_union_tag(part: object) -> bool:
    """Pydantic names union alternatives by type (``str``, ``list[int]``, ``ContentPart``)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list")
                                      or "[" in part or part[:1].isupper())


def _where(loc: tuple) -> str:
    """``(0, 'role')`` -> ``[0].role``; union alternatives are skipped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_union_tag(part):
            out += f".{part}"
    return out


def _describe(err: dict) -> str:
    """The message, prefixed with where inside the field it applies (``[0].role``)."""
    where = _where(err["loc"][1:]).lstrip(".")
    return f"{where}: {err['msg']}" if where else err["msg"]


def from_engine_error(e: BaseException, param: str | None = None) -> OpenAIError:
    """Map what the async engine raises for one request to an HTTP error."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, QueueFullError):
        return OpenAIError(429, f"server busy: {e}; retry later", code="queue_full")
    if isinstance(e, RequestTimeoutError):
        return OpenAIError(408, str(e), code="request_timeout")
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, str(e), code="engine_dead")
    if isinstance(e, EngineStepError):
        return OpenAIError(500, str(e), code="engine_step_failed")
    if isinstance(e, ValueError):
        return OpenAIError(400, str(e), param=param or _param_of(str(e)))
    return OpenAIError(500, f"internal error: {type(e).__name__}: {e}")


def _param_of(message: str) -> str | None:
    """SamplingParams and engine messages start with the offending field's name."""
    word = message.split(" ", 1)[0].strip(":'\"")
    return word if word in _FIELDS else None
