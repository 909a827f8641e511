"""The ``torch`` linear backend: plain ``F.linear`` through the model's own
``nn.Linear``s, on any device and dtype."""

from __future__ import annotations

from torch import nn

from conveyor.model.linear.backend import LinearBackend


class TorchLinearBackend(LinearBackend):
    """Plain ``F.linear`` (the model's own ``nn.Linear``s): any device and dtype."""

    name, packs = "torch", False

    def make_linear(self, weight, bias, gate_up=False):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                           device="meta")
        linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
        if bias is not None:
            linear.bias = nn.Parameter(bias.detach(), requires_grad=False)
        return linear
