"""Which quantization a model runs with: ``--quantization`` and the checkpoint's
``quantization_config`` (no torch).

``int8``: weight-only int8 per output row, quantized at load from any float checkpoint.
``int4``: weight-only int4 in groups (128 input columns where that divides the row, else
64 or 32), asymmetric, the LM head in int8 (as ``int8``).
A checkpoint with a ``quantization_config`` is read in its own format
(``compressed-tensors``, ``gptq``, ``awq``); ``--quantization`` may name that format or
be left unset, and naming another is an error, as is a format not supported.
"""

from __future__ import annotations

from typing import Any

ON_THE_FLY = ("int8", "int4")
CHECKPOINT_FORMATS = ("compressed-tensors", "gptq", "awq")
QUANTIZATION_CHOICES = (*ON_THE_FLY, *CHECKPOINT_FORMATS)
# The KV pool's element type (model/quant/kv_cache.py); fp8 is fp8_e4m3, as in vLLM.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")


def resolve_quantization(hf: dict[str, Any], requested: str | None) -> str | None:
    """The quantization method, or None for a float model; ValueError for a format or
    combination not supported."""
    if requested in (None, "", "none"):
        requested = None
    elif requested not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                         f"got {requested!r}")
    qc = hf.get("quantization_config") or hf.get("compression_config")
    if not qc:
        if requested in CHECKPOINT_FORMATS:
            raise ValueError(f"--quantization {requested}: the checkpoint has no "
                             "quantization_config (a float checkpoint takes int8 or int4)")
        return requested
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    if method not in CHECKPOINT_FORMATS:
        raise ValueError(f"the checkpoint's quantization_config has quant_method "
                         f"{method!r}; supported: {', '.join(CHECKPOINT_FORMATS)}")
    if requested is not None and requested != method:
        raise ValueError(f"--quantization {requested} on a checkpoint quantized with "
                         f"{method}: leave it unset or name {method}")
    return method


def resolve_kv_cache_dtype(name: str | None) -> str:
    """``auto`` (the compute dtype), ``fp8_e4m3``, ``fp8_e5m2`` or ``int8``."""
    name = name or "auto"
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                         f"got {name!r}")
    return "fp8_e4m3" if name == "fp8" else name
