"""The on-disk cache of backend choices measured on this machine (linears, attention):
one JSON file per kind under ``<cache>/``, written atomically so that engines starting
at once never read half a file; an unwritable cache is logged, never fatal."""

from __future__ import annotations

import json
import logging
import os

from conveyor.model.presets import cache_root

logger = logging.getLogger(__name__)


def _path(kind: str) -> str:
    return os.path.join(cache_root(), f"{kind}_choice.json")


def read(kind: str) -> dict:
    """Every entry cached for ``kind`` (``{}`` if none or unreadable)."""
    try:
        with open(_path(kind)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def store(kind: str, key: str, entry: dict) -> None:
    """Add ``entry`` under ``key`` (a re-read of the file first: another engine may have
    written since)."""
    cache = read(kind)
    cache[key] = entry
    path = _path(kind)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(cache, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not cache the %s backend choice: %s", kind, e)
