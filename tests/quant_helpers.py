"""Reference checkpoints for quantized models: the same model with its weights replaced
by their dequantised values (float32), which transformers runs as the reference."""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import load_file, save_file

_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def dequantised_copy(path: str, dequant, head=None) -> str:
    """A copy of float checkpoint ``path`` whose projection weights are
    ``dequant(weight)`` and, with ``head`` (a function like it, or True: ``dequant``), its
    LM head, untied from the embedding, ``head(weight)``."""
    out = tempfile.mkdtemp(prefix="conveyor-deq-")
    for name in os.listdir(path):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(path, name), out)
    tensors = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, name)))
    for name, t in list(tensors.items()):
        if name.endswith(".weight") and name.split(".")[-2] in _PROJ:
            tensors[name] = dequant(t).contiguous()
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    if head:
        head = dequant if head is True else head
        weight = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
        tensors["lm_head.weight"] = head(weight).contiguous()
        cfg["tie_word_embeddings"] = False
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def int8_dequant(weight: torch.Tensor) -> torch.Tensor:
    from conveyor.model.quant.weight import quantize_int8

    return quantize_int8(weight).dequantize()
