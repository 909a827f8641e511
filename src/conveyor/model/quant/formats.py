"""Pre-quantized checkpoint formats read into ``QuantWeight``s.

A checkpoint file is seen through ``QuantizedFile``: the same ``keys`` /
``get_tensor`` / ``get_slice`` as ``safetensors.safe_open``, where each quantized
projection shows as its float name (``...q_proj.weight``) and reads as a
``QuantWeight`` (its integers unpacked, with scales and zero points), and every other
tensor as itself. The loader slices a ``QuantWeight`` for tensor parallelism as it
slices a tensor, and keeps it for the quantized modules.

compressed-tensors (``quant_method: compressed-tensors``): formats ``pack-quantized``
(``weight_packed`` int32, ``weight_shape``, ``weight_scale``, packed
``weight_zero_point`` where asymmetric), ``int-quantized`` / ``naive-quantized``
(``weight`` int8); strategies channel, group and tensor; weight-only (W8A16, W4A16) and
W8A8 with dynamic per-token int8 activations.
Unpacking is compressed-tensors' own (``unpack_from_int32``). Not supported, with an
error naming it: other quantized activations (static, per tensor, fp8), float formats
(fp8, nvfp4, mx), act-order ``weight_g_idx``.

GPTQ and AWQ (``quant_method: gptq`` / ``awq``): int4 (and GPTQ int8) in int32 words,
eight 4-bit values a word from the low bits; GPTQ ``qweight`` [K/8, N] packed along K,
``qzeros`` [G, N/8], ``scales`` [G, N], ``g_idx`` (act-order: each input column's group),
with zeros stored less one in the classic (v1) layout; AWQ ``qweight`` [K, N/8] and
``qzeros`` [G, N/8] packed along N in the order 0, 2, 4, 6, 1, 3, 5, 7, ``scales`` [G, N].
"""

from __future__ import annotations

import re
from typing import Any

import torch
from safetensors import safe_open

from conveyor.model.quant.weight import QuantWeight

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the nibble of each of a word's 8 values


class QuantizedFile:
    """One checkpoint file as ``safe_open`` shows it, quantized projections as
    ``QuantWeight``s; ``index``: every tensor name -> its file (a projection's parts may
    lie in different files of a sharded checkpoint)."""

    def __init__(self, file: str, index: dict[str, str], qc: dict[str, Any]) -> None:
        self.file, self.index, self.qc = file, index, qc
        self.method = str(qc.get("quant_method", "")).lower().replace("_", "-")
        self._handles: dict[str, Any] = {}

    def __enter__(self) -> QuantizedFile:
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles.values():
            h.__exit__(None, None, None)
        self._handles.clear()

    def _get(self, name: str) -> torch.Tensor:
        file = self.index[name]
        if file not in self._handles:
            handle = safe_open(file, framework="pt")
            self._handles[file] = handle.__enter__()
        return self._handles[file].get_tensor(name)

    def _has(self, name: str) -> bool:
        return name in self.index

    def keys(self) -> list[str]:
        out = []
        for name, file in self.index.items():
            if file != self.file:
                continue
            prefix, _, leaf = name.rpartition(".")
            if leaf in ("weight_packed", "qweight"):
                out.append(f"{prefix}.weight")
            elif leaf in _PARTS:
                continue
            else:
                out.append(name)
        return out

    def get_tensor(self, name: str):
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and self._quantized(prefix):
            return self._read(prefix)
        return self._get(name)

    def get_slice(self, name: str):
        value = self.get_tensor(name)
        return value  # (a tensor and a QuantWeight both slice as [rows] and [:, cols])

    def _quantized(self, prefix: str) -> bool:
        return (self._has(f"{prefix}.weight_packed") or self._has(f"{prefix}.qweight")
                or self._has(f"{prefix}.weight_scale"))

    def _read(self, prefix: str) -> QuantWeight:
        if self.method == "compressed-tensors":
            return _read_compressed_tensors(self, prefix)
        if self.method in ("gptq", "awq"):
            return _read_gptq_awq(self, prefix, self.method)
        raise ValueError(f"unsupported quantization format {self.method!r}")


_PARTS = {"weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
          "input_scale", "input_zero_point", "weight_global_scale", "input_global_scale",
          "qzeros", "scales", "g_idx"}


def check_compressed_tensors(qc: dict[str, Any]) -> None:
    """ValueError naming what a compressed-tensors config asks that is not supported."""
    fmt = qc.get("format")
    for name, group in (qc.get("config_groups") or {}).items():
        w = group.get("weights") or {}
        gfmt = group.get("format") or fmt
        act = group.get("input_activations")
        if act and not _w8a8_dynamic(w, act):
            raise ValueError(f"compressed-tensors group {name!r}: quantized input "
                             "activations are supported as W8A8 only (int8 weights per "
                             "channel, int8 activations per token, dynamic, symmetric)")
        if w.get("type", "int") != "int" or w.get("num_bits") not in (4, 8):
            raise ValueError(f"compressed-tensors group {name!r}: {w.get('type')} "
                             f"{w.get('num_bits')}-bit weights are not supported (int4, "
                             "int8 are)")
        if gfmt not in ("pack-quantized", "int-quantized", "naive-quantized"):
            raise ValueError(f"compressed-tensors format {gfmt!r} is not supported "
                             "(pack-quantized, int-quantized, naive-quantized are)")
        if w.get("strategy") not in ("channel", "group", "tensor"):
            raise ValueError(f"compressed-tensors weight strategy {w.get('strategy')!r} is "
                             "not supported (channel, group, tensor are)")
        if w.get("actorder"):
            raise ValueError("compressed-tensors act-order (weight_g_idx) is not supported "
                             "yet")


def _w8a8_dynamic(w: dict[str, Any], act: dict[str, Any]) -> bool:
    return (w.get("num_bits") == 8 and w.get("symmetric", True)
            and w.get("strategy") == "channel" and act.get("num_bits") == 8
            and act.get("type", "int") == "int" and act.get("strategy") == "token"
            and bool(act.get("dynamic")) and act.get("symmetric", True))


def _ct_args(qc: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The config group whose targets match ``prefix``."""
    for group in (qc.get("config_groups") or {}).values():
        for target in group.get("targets", []):
            if target == "Linear" or (target.startswith("re:") and re.match(
                    target[3:], prefix)) or prefix.endswith(target):
                return group
    raise ValueError(f"compressed-tensors: no config group targets {prefix!r}")


def _read_compressed_tensors(f: QuantizedFile, prefix: str) -> QuantWeight:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    group_cfg = _ct_args(f.qc, prefix)
    args = group_cfg["weights"]
    bits = int(args["num_bits"])
    scale = f._get(f"{prefix}.weight_scale").to(torch.float32)
    if f._has(f"{prefix}.weight_packed"):
        shape = torch.Size(f._get(f"{prefix}.weight_shape").tolist())
        q = unpack_from_int32(f._get(f"{prefix}.weight_packed"), bits, shape)
    else:
        q = f._get(f"{prefix}.weight")
    n, k = q.shape
    if scale.numel() == 1:  # strategy tensor
        scale = scale.reshape(1, 1).expand(n, 1)
    scale = scale.reshape(n, -1).contiguous()
    zero = None
    if f._has(f"{prefix}.weight_zero_point"):
        zp = f._get(f"{prefix}.weight_zero_point")
        if zp.dtype == torch.int32 and bits < 8 and zp.shape[0] != n:
            zp = unpack_from_int32(zp, bits, torch.Size((n, scale.shape[1])), packed_dim=0)
        zero = zp.reshape(n, -1).to(torch.float32)
        if zero.shape[1] == 1 and scale.shape[1] == 1 and not bool(zero.any()):
            zero = None
    return QuantWeight(q.to(torch.int8).contiguous(), scale, zero, bits,
                       k // scale.shape[1], act_int8=bool(group_cfg.get("input_activations")))


def _unpack_int32(words: torch.Tensor, bits: int, dim: int,
                  order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 words -> their 32 / bits unsigned values along ``dim`` (low bits first, or
    word position ``order[j]`` holding value j)."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    if order is not None:
        shifts = shifts[list(order)]
    w = words.to(torch.int32).unsqueeze(-1)  # [..., per]
    vals = torch.bitwise_and(torch.bitwise_right_shift(w, shifts), (1 << bits) - 1)
    if dim == 0:  # words [K/per, N]: value j of word r is row r * per + j
        return vals.permute(0, 2, 1).reshape(-1, words.shape[1])
    return vals.reshape(words.shape[0], -1)


def _read_gptq_awq(f: QuantizedFile, prefix: str, method: str) -> QuantWeight:
    bits = int(f.qc.get("bits", f.qc.get("w_bit", 4)))
    if bits not in (4, 8):
        raise ValueError(f"{method}: {bits}-bit weights are not supported (4, 8 are)")
    scales = f._get(f"{prefix}.scales").to(torch.float32)  # [G, N]
    if method == "gptq":
        q = _unpack_int32(f._get(f"{prefix}.qweight"), bits, dim=0)  # [K, N]
        zeros = _unpack_int32(f._get(f"{prefix}.qzeros"), bits, dim=1)  # [G, N]
        if f.qc.get("checkpoint_format", "gptq") != "gptq_v2":
            zeros = zeros + 1  # v1 stores each zero point less one
    else:
        if bits != 4:
            raise ValueError("awq: only 4-bit weights are supported")
        q = _unpack_int32(f._get(f"{prefix}.qweight"), 4, dim=1, order=_AWQ_ORDER)
        zeros = _unpack_int32(f._get(f"{prefix}.qzeros"), 4, dim=1, order=_AWQ_ORDER)
    k = q.shape[0]
    groups = scales.shape[0]
    group = k // groups
    perm = None
    if f._has(f"{prefix}.g_idx"):
        g_idx = f._get(f"{prefix}.g_idx").to(torch.int64)
        if not torch.equal(g_idx, torch.arange(k) // group):
            # act-order: columns sorted by group, so that each group is contiguous
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], torch.arange(k) // group):
                raise ValueError(f"{method}: g_idx of {prefix} does not give every group "
                                 f"{group} columns")
            q = q[perm]  # q is [K, N]: its rows are input columns
    if bits == 8:  # unsigned 0..255: held as int8 with both sides moved by 128
        q, zeros = q - 128, zeros - 128
    return QuantWeight(q.T.contiguous().to(torch.int8), scales.T.contiguous(),
                       zeros.T.contiguous().to(torch.float32), bits, group, perm)
