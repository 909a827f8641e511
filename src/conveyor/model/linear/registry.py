"""The linear backends by name. Each factory imports its backend's module on first
lookup; a backend module never imports this one.

Built in, in priority order: ``native`` (conveyor's GEMM: float32, an AVX2 + FMA CPU, the
kernels built), ``native-bf16`` (the native GEMM on bfloat16 weights, float32
arithmetic: a bfloat16 checkpoint computed in float32), ``onednn`` (float32 on CPU, or
bfloat16 where the CPU has it natively, a torch with oneDNN), then ``torch`` (plain
``F.linear``, anywhere). Adding one is a module with its ``LinearBackend`` subclass and
one ``linear_backends.add`` line here (or ``register_linear_backend`` on a class from
outside).
"""

from __future__ import annotations

import torch

from conveyor.model.backend_registry import Registry
from conveyor.model.linear.backend import LinearBackend


def _native() -> type[LinearBackend]:
    from conveyor.model.linear.native import NativeLinearBackend

    return NativeLinearBackend


def _native_bf16() -> type[LinearBackend]:
    from conveyor.model.linear.native import NativeBf16WeightLinearBackend

    return NativeBf16WeightLinearBackend


def _onednn() -> type[LinearBackend]:
    from conveyor.model.linear.onednn import OneDnnLinearBackend

    return OneDnnLinearBackend


def _torch() -> type[LinearBackend]:
    from conveyor.model.linear.plain import TorchLinearBackend

    return TorchLinearBackend


linear_backends: Registry[type[LinearBackend]] = Registry("linear")
linear_backends.add("native", 20, _native)
linear_backends.add("native-bf16", 15, _native_bf16)
linear_backends.add("onednn", 10, _onednn)
linear_backends.add("torch", 0, _torch)

register_linear_backend = linear_backends.register
unregister_linear_backend = linear_backends.unregister
linear_backend = linear_backends.get
linear_backend_names = linear_backends.names


def linear_backend_choices() -> tuple[str, ...]:
    """The names ``linear_backend`` takes, as registered now: ``auto`` then each."""
    return ("auto", *linear_backend_names())


def linear_backend_names_for(device: torch.device | str, dtype: torch.dtype,
                             weight_dtype: torch.dtype | None = None) -> list[str]:
    """The registered linear backends that support this configuration, by priority."""
    return linear_backends.applicable(torch.device(device), dtype, weight_dtype=weight_dtype)


def select_linear_backend(name: str, device: torch.device | str, dtype: torch.dtype,
                          weight_dtype: torch.dtype | None = None) -> LinearBackend:
    """An instance of linear backend ``name`` (or the ``auto`` choice)."""
    device = torch.device(device)
    return linear_backends.select(name, device, dtype, weight_dtype=weight_dtype)(device,
                                                                                 dtype)


def pick_linear_backend(backend: str, device: torch.device, dtype: torch.dtype,
                        weight_dtype: torch.dtype | None = None) -> str:
    """Which linears a model gets, by name: a registered backend or ``auto``, the first
    registered that applies."""
    return select_linear_backend(backend, device, dtype, weight_dtype).name
