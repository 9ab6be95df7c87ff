"""Shared by the GPU tests: the error measure, and one forward+backward of a layer."""

GRAD_NAMES = ("y", "dx", "dW13", "dW2", "dWr", "db13", "db2")


def rel_err(a, b):
    """||a - b|| / ||b|| in float64, in chunks along dim 0 (weight gradients can be large)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    num = den = 0.0
    for u, v in zip(a.reshape(a.shape[0], -1).split(16), b.reshape(b.shape[0], -1).split(16)):
        u, v = u.double(), v.double()
        num += (u - v).pow(2).sum().item()
        den += v.pow(2).sum().item()
    return (num / max(den, 1e-300)) ** 0.5


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
