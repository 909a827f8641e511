"""Chat templates: found next to the tokenizer, rendered in a sandboxed Jinja2 environment.

A checkpoint's template is code from whoever published the checkpoint, and the
messages it renders come from clients, so it runs in Jinja2's immutable sandbox
(no attribute escapes, no mutation of the objects passed in). jinja2 >= 3.1.6 is
required: older releases have known sandbox escapes.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


class ChatTemplateError(ValueError):
    """The template failed on these messages (raise_exception, a type error, ...)."""


def find_chat_template(tokenizer_dir: str | None, override: str | None = None) -> str | None:
    """The template source: ``override`` (a file or the template itself), else the checkpoint's.

    Looks in tokenizer_config.json (``chat_template``: a string, or a list of named
    templates of which ``default`` is used), then chat_template.jinja / .json.
    """
    if override is not None:
        if os.path.isfile(override):
            with open(override) as f:
                return f.read()
        if "{" not in override:
            raise ValueError(f"--chat-template {override!r} is neither a file nor a template")
        return override
    if tokenizer_dir is None:
        return None
    cfg_file = os.path.join(tokenizer_dir, "tokenizer_config.json")
    if os.path.isfile(cfg_file):
        with open(cfg_file) as f:
            template = _pick(json.load(f).get("chat_template"))
        if template:
            return template
    for name in _TEMPLATE_FILES:
        path = os.path.join(tokenizer_dir, name)
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            text = f.read()
        return _pick(json.loads(text).get("chat_template")) if name.endswith(".json") else text
    return None


def _pick(template: Any) -> str | None:
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(m) for m in re.findall(r"\d+", text)[:3])


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which chat templates do not want.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str | None] | None = None) -> None:
        if _version(jinja2.__version__) < (3, 1, 6):
            raise RuntimeError(f"chat templates need jinja2 >= 3.1.6 (sandbox fixes), "
                               f"found {jinja2.__version__}")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not parse: {e}") from None
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        """The prompt text for ``messages``; ChatTemplateError if the template refuses them."""
        context = {**kwargs, **self.special_tokens, "messages": messages,
                   "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(**context)
        except ChatTemplateError:
            raise
        except Exception as e:  # SecurityError, TypeError on a missing field, ...
            raise ChatTemplateError(f"{type(e).__name__}: {e}") from None


def special_tokens_of(tokenizer: Any) -> dict[str, str | None]:
    """The special-token strings templates refer to (``bos_token``, ``eos_token``, ...)."""
    if tokenizer is None:
        return {}
    names = ("bos_token", "eos_token", "pad_token", "unk_token")
    return {name: _as_str(getattr(tokenizer, name, None)) for name in names}


def _as_str(token: Any) -> str | None:
    if token is None or isinstance(token, str):
        return token
    return str(getattr(token, "content", token))
