"""Shared by the GPU tests: the error measure, one forward+backward of a layer, an fp64 oracle of routed
GEMM rows, and the loader of a CPU test module."""

import importlib.util
import pathlib
import sys

import torch

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


def slot_products(x, ids, W, transpose_w):
    """fp64 [T*k, N]: row (t, j) = x[t] @ W[e] (transpose_w) or x[t] @ W[e]^T, e = ids[t, j], expert by expert."""
    flat = ids.reshape(-1)
    xs = x.double().repeat_interleave(ids.shape[1], 0)
    out = torch.empty(flat.numel(), W.shape[2] if transpose_w else W.shape[1], dtype=torch.float64, device=x.device)
    for e in flat.unique().tolist():
        sel = flat == e
        We = W[e].double()
        out[sel] = xs[sel] @ (We if transpose_w else We.T)
    return out


def load_cpu_test(name):
    """A module of tests/ (the CPU tests) by file name, e.g. an oracle kept there; the CPU test modules
    import each other by name, so tests/ goes on sys.path."""
    tests = pathlib.Path(__file__).resolve().parents[1]
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))
    spec = importlib.util.spec_from_file_location(name, tests / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
