"""The loader's two hooks for pre-quantized checkpoints: each file opened through
``formats.QuantizedFile`` where the model is quantized in its checkpoint, and each
``QuantWeight`` read kept (``model.quant_weights``) while its parameter gets the
dequantised values (so the float model is the reference; ``apply.py`` then swaps the
quantized modules in)."""

from __future__ import annotations

import functools

import torch
from safetensors import safe_open

from conveyor.config.quantization import CHECKPOINT_FORMATS
from conveyor.model.quant.weight import QuantWeight


def open_weights(file: str, files: list[str], cfg):
    """``safe_open(file)``, or its quantized view for a pre-quantized checkpoint."""
    if getattr(cfg, "quantization", None) not in CHECKPOINT_FORMATS:
        return safe_open(file, framework="pt")
    from conveyor.model.quant.formats import QuantizedFile, check_compressed_tensors

    qc = cfg.hf_config.get("quantization_config") or cfg.hf_config["compression_config"]
    if cfg.quantization == "compressed-tensors":
        check_compressed_tensors(qc)
    return QuantizedFile(file, _index(tuple(files)), qc)


@functools.cache
def _index(files: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


def keep_quantized(model, our_name: str, shard: int | None, tensor, dtype: torch.dtype):
    """The tensor to copy into the parameter: a ``QuantWeight`` kept for ``apply.py``
    and dequantised, anything else as it is."""
    if not isinstance(tensor, QuantWeight):
        return tensor
    if not hasattr(model, "quant_weights"):
        model.quant_weights = {}
    model.quant_weights.setdefault(our_name, {})[shard] = tensor
    return tensor.dequantize(dtype)
