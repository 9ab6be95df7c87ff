"""mok_nn.ops on the CUDA kernels: equal to the CUDA backend behind the layer, bitwise;
differentiable; traceable by torch.compile (fullgraph) with the same bits."""

import pytest
import torch

from mok_nn import cuda_backend, ops, router

cuda_ok = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not cuda_ok, reason="needs an sm_90 CUDA GPU")


def _inputs(T=333, H=256, I=128, E=16, K=4):
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16).requires_grad_()

    x, w13, w2 = rnd(T, H), rnd(E, 2 * I, H, scale=H ** -0.5), rnd(E, H, I, scale=I ** -0.5)
    ids, wt, _ = router.route(torch.randn(T, E, device="cuda", generator=g), K)
    return x, ids, wt.detach().requires_grad_(), w13, w2


def _grads(fn, x, ids, wt, w13, w2, dy):
    for t in (x, wt, w13, w2):
        t.grad = None
    y = fn(x, ids, wt, w13, w2)
    y.backward(dy)
    return [y.detach()] + [t.grad.clone() for t in (x, wt, w13, w2)]


def test_ops_cuda_equal_backend_and_compile():
    x, ids, wt, w13, w2 = _inputs()
    assert ops.resolve_backend("auto", x, ids, w13, w2, "swiglu") == "cuda"
    dy = torch.randn_like(x)
    eager = _grads(lambda *a: ops.routed_experts(*a, backend="cuda"), x, ids, wt, w13, w2, dy)
    again = _grads(lambda *a: ops.routed_experts(*a, backend="cuda"), x, ids, wt, w13, w2, dy)
    y_b, saved = cuda_backend.experts_forward(x, ids, wt, w13, w2)
    dx_b, dw_b, g_b = cuda_backend.experts_backward(dy, saved, x, ids, wt, w13, w2)
    direct = [y_b, dx_b, dw_b.to(wt.dtype), g_b.gate_up_proj, g_b.down_proj]
    compiled_fn = torch.compile(lambda *a: ops.routed_experts(*a, backend="cuda"), fullgraph=True,
                                backend="aot_eager")
    compiled = _grads(compiled_fn, x, ids, wt, w13, w2, dy)
    for name, a, b, c, d in zip(("y", "dx", "dw", "dW13", "dW2"), eager, again, direct, compiled):
        assert torch.equal(a, b), f"{name}: not bitwise reproducible"
        assert torch.equal(a, c), f"{name}: ops differ from cuda_backend"
        assert torch.equal(a, d), f"{name}: torch.compile changed the result"
