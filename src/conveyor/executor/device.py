"""The torch device an executor or a tensor-parallel rank runs on."""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
