"""The linear backends by name. Each backend's module is imported on first lookup; a
backend module never imports this one.

Built in, in priority order: ``native`` (conveyor's GEMM: float32, an AVX2 + FMA CPU, the
kernels built), ``native-bf16`` (the native GEMM on bfloat16 weights, float32
arithmetic: a bfloat16 checkpoint computed in float32), ``onednn`` (float32 on CPU, or
bfloat16 where the CPU has it natively, a torch with oneDNN), then ``torch`` (plain
``F.linear``, anywhere). Adding one is a module with its ``LinearBackend`` subclass and
one ``linear_backends.add`` line here (or ``linear_backends.register`` on a class from
outside).
"""

from __future__ import annotations

import torch

from conveyor.model.backend_registry import Registry
from conveyor.model.linear.backend import LinearBackend

linear_backends: Registry[type[LinearBackend]] = Registry("linear")
linear_backends.add("native", 20, "conveyor.model.linear.native:NativeLinearBackend")
linear_backends.add("native-bf16", 15,
                    "conveyor.model.linear.native:NativeBf16WeightLinearBackend")
linear_backends.add("onednn", 10, "conveyor.model.linear.onednn:OneDnnLinearBackend")
linear_backends.add("torch", 0, "conveyor.model.linear.plain:TorchLinearBackend")


def linear_backend_choices() -> tuple[str, ...]:
    """The names ``linear_backend`` takes, as registered now: ``auto`` then each."""
    return ("auto", *linear_backends.names())


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
