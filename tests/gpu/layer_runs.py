"""Shared by the GPU layer tests: one forward+backward of a layer, and the error measure."""

import torch

GRAD_NAMES = ("y", "dx", "dW13", "dW2", "dWr", "db13", "db2")


def rel_err(a, b):
    """Relative L2 error of a against b, in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run_layer(layer, x, dy):
    """[y, dx, d gate_up_proj, d down_proj, d router.weight (, d biases)] of one forward+backward."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    e = layer.experts
    out = [y.detach(), x.grad, e.gate_up_proj.grad, e.down_proj.grad, layer.router.weight.grad]
    if e.gate_up_proj_bias is not None:
        out += [e.gate_up_proj_bias.grad, e.down_proj_bias.grad]
    return out
