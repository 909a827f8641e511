"""GPTQ and AWQ int4 checkpoints packed by the test from a float one (their layouts:
int32 words of eight 4-bit values; GPTQ along K with zero points stored less one and
g_idx, act-order included; AWQ along N in its interleaved order), float16 scales, with
the dequantised float32 reference beside them."""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import load_file, save_file

from helpers import make_checkpoint

_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _pack(vals: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[R, C * 8] values 0..15 -> [R, C] int32, value j of a word at nibble order[j]."""
    v = vals.to(torch.int64).view(vals.shape[0], -1, 8)
    word = torch.zeros(v.shape[:2], dtype=torch.int64)
    for j in range(8):
        word |= v[..., j] << (4 * order[j])
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _quantize(w: torch.Tensor, group: int, g_idx: torch.Tensor):
    """Asymmetric int4 of each column's group g_idx[k]: (q [N, K], scale [N, G] fp16,
    zero [N, G])."""
    groups = w.shape[1] // group
    lo = torch.stack([w[:, g_idx == g].amin(1) for g in range(groups)], 1).clamp(max=0)
    hi = torch.stack([w[:, g_idx == g].amax(1) for g in range(groups)], 1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp_min(1e-6).half()
    zero = torch.round(-lo / scale.float()).clamp(1, 15)  # (>= 1: GPTQ v1 stores zero - 1)
    q = (torch.round(w / scale.float()[:, g_idx]) + zero[:, g_idx]).clamp(0, 15)
    return q, scale, zero


@functools.cache
def write_checkpoint(method: str, act_order: bool = False, arch: str = "llama",
                     group: int = 16) -> tuple[str, str]:
    """(the quantized checkpoint, its dequantised float32 reference)."""
    src = make_checkpoint(arch)
    tensors = {}
    for name in os.listdir(src):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, name)))
    out = {k: v for k, v in tensors.items()
           if not (k.endswith(".weight") and k.split(".")[-2] in _PROJ)}
    ref = dict(tensors)
    gen = torch.Generator().manual_seed(0)
    perms: dict[int, torch.Tensor] = {}
    for name, w in tensors.items():
        if not (name.endswith(".weight") and name.split(".")[-2] in _PROJ):
            continue
        prefix = name.removesuffix(".weight")
        n, k = w.shape
        g_idx = torch.arange(k) // group
        if act_order:  # one permutation per input width: Q/K/V and gate/up share theirs
            perm = perms.setdefault(k, torch.randperm(k, generator=gen))
            g_idx = torch.argsort(perm) // group
        q, scale, zero = _quantize(w, group, g_idx)
        ref[name] = ((q - zero[:, g_idx]) * scale.float()[:, g_idx]).contiguous()
        if method == "gptq":
            out[f"{prefix}.qweight"] = _pack(q.T.contiguous().view(k // 8, 8, n)
                                             .permute(0, 2, 1).reshape(k // 8, n * 8))
            out[f"{prefix}.qzeros"] = _pack((zero - 1).T.contiguous())
            out[f"{prefix}.scales"] = scale.T.contiguous()
            out[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
        else:
            out[f"{prefix}.qweight"] = _pack(q.T.contiguous(), AWQ_ORDER)
            out[f"{prefix}.qzeros"] = _pack(zero.T.contiguous(), AWQ_ORDER)
            out[f"{prefix}.scales"] = scale.T.contiguous()
    path = tempfile.mkdtemp(prefix=f"conveyor-{method}-")
    ref_path = tempfile.mkdtemp(prefix=f"conveyor-{method}-ref-")
    for d, ts in ((path, out), (ref_path, ref)):
        for name in os.listdir(src):
            if not name.endswith(".safetensors"):
                shutil.copy(os.path.join(src, name), d)
        save_file({k: v.contiguous() for k, v in ts.items()},
                  os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
         "sym": False, "checkpoint_format": "gptq"} if method == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
         "version": "gemm"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path, ref_path
