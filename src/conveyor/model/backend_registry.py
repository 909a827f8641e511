"""Backends of one kind (attention, linear) by name, their classes imported on first use.

A backend class has a ``name`` and a ``supports(...)`` check that returns None or the
reason it does not apply to a device, dtype and model shape. A registry holds, per name,
a priority and a factory that imports and returns the class: the built-in backends'
modules are imported only when a lookup reaches them, and they never import a registry
(so a backend module may import whatever it needs without a cycle).

``auto`` takes the backend of highest priority whose check passes; a backend forced by
name that does not apply raises ``BackendUnavailableError`` with its reason, and an
unknown name a ValueError listing the registered ones.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar


class BackendUnavailableError(ValueError, RuntimeError):
    """A backend asked for by name that cannot run here (the message says why).

    A ValueError, as a setting that does not fit the machine or model, and a RuntimeError,
    as callers caught missing native kernels before backends were registered."""


B = TypeVar("B", bound=type)


@dataclass
class _Entry(Generic[B]):
    priority: int
    factory: Callable[[], B]
    cls: B | None = None

    def load(self) -> B:
        if self.cls is None:
            self.cls = self.factory()
        return self.cls


class Registry(Generic[B]):
    """Backend classes of one kind by name; ``auto`` tries them by descending priority
    (ties: in registration order)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, _Entry[B]] = {}

    def add(self, name: str, priority: int, where: str) -> None:
        """Registers ``name``, the class ``where`` (``"package.module:Class"``) names,
        imported when first looked up."""
        if not isinstance(name, str) or not name or name == "auto":
            raise ValueError(f"a {self.kind} backend needs a name other than 'auto', "
                             f"got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.kind} backend {name!r} is already registered")
        module, _, cls = where.partition(":")
        self._entries[name] = _Entry(
            priority, lambda: getattr(importlib.import_module(module), cls))

    def register(self, cls: B) -> B:
        """Class decorator: adds a class already imported under ``cls.name`` (unique, not
        ``auto``) at ``cls.priority``."""
        name = getattr(cls, "name", "")
        if not isinstance(name, str) or not name or name == "auto":
            raise ValueError(f"a {self.kind} backend needs a name other than 'auto', "
                             f"got {name!r} on {cls.__name__}")
        if name in self._entries:
            raise ValueError(f"{self.kind} backend {name!r} is already registered")
        self._entries[name] = _Entry(getattr(cls, "priority", 0), lambda: cls, cls)
        return cls

    def unregister(self, name: str) -> B:
        """Removes and returns the backend ``name`` (tests register their own)."""
        cls = self.get(name)
        del self._entries[name]
        return cls

    def names(self) -> tuple[str, ...]:
        """Registered names in the order ``auto`` tries them."""
        order = {name: i for i, name in enumerate(self._entries)}
        return tuple(sorted(self._entries,
                            key=lambda n: (-self._entries[n].priority, order[n])))

    def get(self, name: str) -> B:
        entry = self._entries.get(name)
        if entry is None:
            names = self.names()
            listing = ", ".join(("auto", *names[:-1])) + (f" or {names[-1]}" if names else "")
            raise ValueError(f"{self.kind}_backend must be one of {listing}, got {name!r}")
        return entry.load()

    def select(self, name: str, *args, **kwargs) -> B:
        """The class for ``name`` (or ``auto``) given ``supports``'s arguments."""
        if name != "auto":
            cls = self.get(name)
            reason = cls.supports(*args, **kwargs)
            if reason is not None:
                raise BackendUnavailableError(f"{self.kind}_backend={name!r}: {reason}")
            return cls
        reasons = []
        for candidate in self.names():
            cls = self.get(candidate)
            reason = cls.supports(*args, **kwargs)
            if reason is None:
                return cls
            reasons.append(f"{candidate}: {reason}")
        raise BackendUnavailableError(f"no {self.kind} backend applies ("
                                      + "; ".join(reasons) + ")")

    def applicable(self, *args, **kwargs) -> list[str]:
        """The registered names whose ``supports`` passes these arguments, by priority."""
        return [n for n in self.names() if self.get(n).supports(*args, **kwargs) is None]
