"""Attention and linear backends, registered by name.

A backend is a class with a ``name``, a ``priority`` and a ``supports(...)`` check that
returns None or the reason it does not apply to a device, dtype and model shape; an
instance builds the backend's kernels. ``attention_backend="auto"`` (and
``linear_backend="auto"``) takes the registered backend of highest priority whose check
passes; a backend forced by name that does not apply raises ``BackendUnavailableError``
with its reason, and an unknown name a ValueError listing the registered ones.

Adding one, say FlashInfer's decode on CUDA, is one class::

    @register_attention_backend
    class FlashInferBackend(AttentionBackend):
        name, priority = "flashinfer", 200
        @classmethod
        def supports(cls, device, dtype, num_heads, num_kv_heads, head_dim=None):
            return None if device.type == "cuda" else "needs a CUDA device"
        def decode_kernel(self):
            return FlashInferDecode(self.num_heads, self.num_kv_heads)

Registered here, in priority order: attention ``native`` (the C kernels on CPU, float32
or bfloat16) then ``sdpa`` (anywhere); linears ``native`` (conveyor's GEMM: float32, an
AVX2 + FMA CPU, the kernels built), ``onednn`` (float32 on CPU, a torch with oneDNN) then
``torch`` (plain ``F.linear``, anywhere), and ``native-bf16`` (the native GEMM on bfloat16
weights, float32 arithmetic: a bfloat16 checkpoint computed in float32) between native
and oneDNN.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Generic, TypeVar

import torch
from torch import nn

from conveyor.model import kernels
from conveyor.model.decode_attention import NativeDecode, NativePrefill, sdpa_decode
from conveyor.model.dtypes import cpu_has_native_bf16
from conveyor.model.layer_ops import NativeOps, TorchOps
from conveyor.model.packed_linear import (
    NativeLinear,
    PackedLinear,
    native_gemm_lib,
    onednn_available,
)


class BackendUnavailableError(ValueError, RuntimeError):
    """A backend asked for by name that cannot run here (the message says why).

    A ValueError, as a setting that does not fit the machine or model, and a RuntimeError,
    as callers caught missing native kernels before backends were registered."""


B = TypeVar("B", bound=type)


class Registry(Generic[B]):
    """Backend classes of one kind by name; ``auto`` tries them by descending priority
    (ties: in registration order)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, B] = {}

    def register(self, cls: B) -> B:
        """Class decorator: adds ``cls`` under ``cls.name`` (unique, not ``auto``)."""
        name = getattr(cls, "name", "")
        if not isinstance(name, str) or not name or name == "auto":
            raise ValueError(f"a {self.kind} backend needs a name other than 'auto', "
                             f"got {name!r} on {cls.__name__}")
        if name in self._classes:
            raise ValueError(f"{self.kind} backend {name!r} is already registered "
                             f"({self._classes[name].__name__})")
        self._classes[name] = cls
        return cls

    def unregister(self, name: str) -> B:
        """Removes and returns the backend ``name`` (tests register their own)."""
        self.get(name)
        return self._classes.pop(name)

    def names(self) -> tuple[str, ...]:
        """Registered names in the order ``auto`` tries them."""
        order = {name: i for i, name in enumerate(self._classes)}
        return tuple(sorted(self._classes,
                            key=lambda n: (-self._classes[n].priority, order[n])))

    def get(self, name: str) -> B:
        cls = self._classes.get(name)
        if cls is None:
            names = self.names()
            listing = ", ".join(("auto", *names[:-1])) + (f" or {names[-1]}" if names else "")
            raise ValueError(f"{self.kind}_backend must be one of {listing}, got {name!r}")
        return cls

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
            cls = self._classes[candidate]
            reason = cls.supports(*args, **kwargs)
            if reason is None:
                return cls
            reasons.append(f"{candidate}: {reason}")
        raise BackendUnavailableError(f"no {self.kind} backend applies ("
                                      + "; ".join(reasons) + ")")


# --- attention ------------------------------------------------------------------------

class AttentionBackend:
    """Decode attention over the paged cache, and optionally a fresh-prompt prefill kernel
    and fused elementwise ops that go with it (see attention.py for the signatures)."""

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 0

    def __init__(self, device: torch.device, dtype: torch.dtype, num_heads: int,
                 num_kv_heads: int, head_dim: int | None = None) -> None:
        self.device, self.dtype = device, dtype
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, num_heads: int,
                 num_kv_heads: int, head_dim: int | None = None) -> str | None:
        """None if the backend can run this configuration, else why not."""
        return None

    def decode_kernel(self) -> Callable:
        """``(q, k_cache, v_cache, meta, scale) -> out``; its ``needs_mask`` attribute says
        whether ``meta.decode_mask`` must be built."""
        raise NotImplementedError

    def prefill_kernel(self) -> Callable | None:
        """``(q, k, v, out, scale) -> bool`` for a fresh prompt, or None (SDPA)."""
        return None

    def layer_ops(self) -> TorchOps | None:
        """The decoder's elementwise ops to install, or None to keep ``TorchOps``."""
        return None


attention_backends: Registry[type[AttentionBackend]] = Registry("attention")
register_attention_backend = attention_backends.register
unregister_attention_backend = attention_backends.unregister
attention_backend = attention_backends.get
attention_backend_names = attention_backends.names


def attention_backend_names_for(device: torch.device | str, dtype: torch.dtype,
                                num_heads: int, num_kv_heads: int,
                                head_dim: int | None = None) -> list[str]:
    """The registered attention backends that support this model, by priority."""
    device = torch.device(device)
    return [n for n in attention_backends.names()
            if attention_backends.get(n).supports(device, dtype, num_heads, num_kv_heads,
                                                  head_dim=head_dim) is None]


def select_attention_backend(name: str, device: torch.device | str, dtype: torch.dtype,
                             num_heads: int, num_kv_heads: int,
                             head_dim: int | None = None) -> AttentionBackend:
    """An instance of attention backend ``name`` (or the ``auto`` choice) for this model."""
    device = torch.device(device)
    cls = attention_backends.select(name, device, dtype, num_heads, num_kv_heads,
                                    head_dim=head_dim)
    return cls(device, dtype, num_heads, num_kv_heads, head_dim)


@register_attention_backend
class NativeAttentionBackend(AttentionBackend):
    """The C kernels of ``kernels/`` (CPU): decode over float32 or bfloat16 caches; with
    a float32 model also the fresh-prompt prefill and the fused elementwise ops."""

    name, priority = "native", 100

    @classmethod
    def supports(cls, device, dtype, num_heads, num_kv_heads, head_dim=None):
        if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return "needs a CPU device and a float32 or bfloat16 model"
        if kernels.load() is None:
            return "the native kernels are unavailable " + kernels.why_unavailable()
        return None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lib = kernels.load()

    def decode_kernel(self) -> NativeDecode:
        return NativeDecode(self.lib)

    def prefill_kernel(self) -> NativePrefill | None:
        return (NativePrefill(self.lib) if self.dtype in (torch.float32, torch.bfloat16)
                else None)

    def layer_ops(self) -> NativeOps | None:
        # bfloat16 too: the kernels compute in fp32 and round where TorchOps does.
        return (NativeOps(self.lib) if self.dtype in (torch.float32, torch.bfloat16)
                else None)


@register_attention_backend
class SdpaAttentionBackend(AttentionBackend):
    """Gather + padded ``scaled_dot_product_attention``: any device and dtype."""

    name, priority = "sdpa", 0

    def decode_kernel(self) -> Callable:
        return sdpa_decode


# --- linears --------------------------------------------------------------------------

class LinearBackend:
    """How a model's projections run. ``packs``: whether ``pack_linears`` replaces each
    ``nn.Linear`` by ``make_linear``'s module (False: the model keeps its own)."""

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 0
    packs: ClassVar[bool] = True

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype,
                 weight_dtype: torch.dtype | None = None) -> str | None:
        """None if the backend can run this configuration, else why not. ``dtype``: the
        arithmetic's; ``weight_dtype``: the checkpoint's, where it differs (a bfloat16
        model computed in float32), else None."""
        return None

    def make_linear(self, weight: torch.Tensor, bias: torch.Tensor | None,
                    gate_up: bool = False) -> nn.Module:
        """The module computing ``x @ weight.T + bias``; with ``gate_up`` it may return
        ``silu(gate) * up`` instead, and then has ``applies_silu_mul = True``."""
        raise NotImplementedError


linear_backends: Registry[type[LinearBackend]] = Registry("linear")
register_linear_backend = linear_backends.register
unregister_linear_backend = linear_backends.unregister
linear_backend = linear_backends.get
linear_backend_names = linear_backends.names


def linear_backend_names_for(device: torch.device | str, dtype: torch.dtype,
                              weight_dtype: torch.dtype | None = None) -> list[str]:
    """The registered linear backends that support this configuration, by priority."""
    device = torch.device(device)
    return [n for n in linear_backends.names()
            if linear_backends.get(n).supports(device, dtype,
                                               weight_dtype=weight_dtype) is None]


def select_linear_backend(name: str, device: torch.device | str, dtype: torch.dtype,
                          weight_dtype: torch.dtype | None = None) -> LinearBackend:
    """An instance of linear backend ``name`` (or the ``auto`` choice)."""
    device = torch.device(device)
    return linear_backends.select(name, device, dtype, weight_dtype=weight_dtype)(device,
                                                                                 dtype)


def _fp32_cpu(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32


@register_linear_backend
class NativeLinearBackend(LinearBackend):
    """conveyor's GEMM (``kernels/gemm.c``), weights pre-packed, SwiGLU fused into the
    gate/up projection."""

    name, priority = "native", 20
    _needs = "needs a float32 model on a CPU with AVX2 and FMA, and the native kernels built"

    @classmethod
    def supports(cls, device, dtype, weight_dtype=None):
        if not _fp32_cpu(device, dtype):
            return f"{cls._needs} (got {str(dtype).removeprefix('torch.')} on {device})"
        if kernels.load() is None:
            return f"{cls._needs} {kernels.why_unavailable()}"
        if native_gemm_lib() is None:
            return f"{cls._needs} (this CPU lacks AVX2 or FMA)"
        return None

    def make_linear(self, weight, bias, gate_up=False):
        return NativeLinear(weight, bias, native_gemm_lib(), gate_up=gate_up)


@register_linear_backend
class NativeBf16WeightLinearBackend(NativeLinearBackend):
    """conveyor's GEMM reading bfloat16 weights, float32 arithmetic: for a bfloat16
    checkpoint computed in float32 (CPUs without bf16 arithmetic), the same bits as
    ``native`` from half the weight bytes, which is what a decode step is bound by."""

    name, priority = "native-bf16", 15

    @classmethod
    def supports(cls, device, dtype, weight_dtype=None):
        if weight_dtype != torch.bfloat16 or dtype != torch.float32:
            return ("needs a bfloat16 checkpoint computed in float32 (--dtype bfloat16 "
                    "where the CPU lacks bf16 arithmetic, or --compute-dtype float32)")
        return super().supports(device, dtype)

    def make_linear(self, weight, bias, gate_up=False):
        return NativeLinear(weight, bias, native_gemm_lib(), gate_up=gate_up,
                            bf16_weight=True)


@register_linear_backend
class OneDnnLinearBackend(LinearBackend):
    """oneDNN (bundled with torch's CPU builds) with the weight re-blocked once."""

    name, priority = "onednn", 10

    @classmethod
    def supports(cls, device, dtype, weight_dtype=None):
        # bfloat16 where the CPU multiplies it natively (AVX-512 BF16, AMX: oneDNN picks
        # the instructions): packed, 1.1-1.9x F.linear's speed on a Zen 5, same bits.
        ok = device.type == "cpu" and (dtype == torch.float32 or (
            dtype == torch.bfloat16 and cpu_has_native_bf16()))
        if not (ok and onednn_available()):
            return ("needs a float32 model (or bfloat16 on a CPU with native bf16) on CPU "
                    "and a torch built with oneDNN (mkldnn)")
        return None

    def make_linear(self, weight, bias, gate_up=False):
        return PackedLinear(weight, bias)


@register_linear_backend
class TorchLinearBackend(LinearBackend):
    """Plain ``F.linear`` (the model's own ``nn.Linear``s): any device and dtype."""

    name, priority, packs = "torch", 0, False

    def make_linear(self, weight, bias, gate_up=False):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                           device="meta")
        linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias.detach(), requires_grad=False)
        return linear
