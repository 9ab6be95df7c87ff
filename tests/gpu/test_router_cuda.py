"""The router logits on CUDA: one tensor-core GEMM with an fp32 output for bf16 / fp16 x and weights
(router.router_logits), against a float64 evaluation of the same products."""

import pytest
import torch

from mok_nn import MoKMoELayer
from mok_nn import router as routing

U32 = 2.0**-24  # fp32 unit roundoff


def _sum_bound(x, w):
    """Elementwise bound on an fp32 sum of the H exact products x_i w_i: blocked summation with at most
    H / 16 sequential additions of partial sums (k = 16 per bf16 tensor-core step), each partial sum a tree of
    depth at most 8, and a factor 2 for tensor cores' truncating adds: c u sum_i |x_i w_i|, c = 2 (H / 16 + 8).
    A bf16 rounding anywhere on the way (2^-9 relative) is far outside it."""
    h = x.shape[1]
    c = 2 * (h / 16 + 8)
    return c * U32 * (x.double().abs() @ w.double().abs().T)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 256, 8), (777, 1024, 64), (4096, 2048, 128), (300, 7168, 256)])
def test_logits_are_fp32_sums_of_exact_products_and_repeat(dtype, shape):
    t, h, e = shape
    torch.manual_seed(t + h)
    x = torch.randn(t, h, device="cuda").to(dtype)
    w = (torch.randn(e, h, device="cuda") / h**0.5).to(dtype)
    assert routing._tensor_core_logits_run_on(x, w)
    got = routing.router_logits(x, w)
    assert got.dtype == torch.float32 and got.shape == (t, e)
    assert torch.equal(got, routing.router_logits(x, w)), "not bitwise reproducible"
    exact = x.double() @ w.double().T
    err = (got.double() - exact).abs()
    bound = _sum_bound(x, w)
    assert (err <= bound).all(), f"max err/bound {(err / bound).max().item():.3g}"
    # and it is not the bf16-rounded result: rounding the exact logits to the 16-bit dtype lands outside the bound
    rounded = (exact.to(dtype).double() - exact).abs()
    assert (rounded > bound).any()


def test_bias_and_backward_match_the_fp32_formula():
    torch.manual_seed(1)
    t, h, e = 1000, 2048, 128
    x = torch.randn(t, h, device="cuda").to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(e, h, device="cuda") / h**0.5).to(torch.bfloat16).requires_grad_(True)
    b = torch.randn(e, device="cuda").to(torch.bfloat16).requires_grad_(True)
    d = torch.randn(t, e, device="cuda")
    got = routing.router_logits(x, w, b)
    gx, gw, gb = torch.autograd.grad(got, (x, w, b), d)
    # the backward is that of x.float() @ w.float().T + b.float() (fp32 d logits), bit for bit
    x2, w2, b2 = (v.detach().clone().requires_grad_(True) for v in (x, w, b))
    want = x2.float() @ w2.float().T + b2.float()
    wx, ww, wb = torch.autograd.grad(want, (x2, w2, b2), d)
    assert torch.equal(gx, wx) and torch.equal(gw, ww) and torch.equal(gb, wb)
    # and against float64: d x and d w are fp32 sums rounded once to bf16
    for g, exact in ((gx, d.double() @ w.double()), (gw, d.double().T @ x.double())):
        assert g.dtype == torch.bfloat16
        err = (g.double() - exact).abs()
        assert (err <= exact.abs() * 2.0**-8 + 1e-3 * exact.abs().max()).all()
    # logits with the bias: fp32 logits plus the bias, against float64
    exact = x.double() @ w.double().T + b.double()
    bound = _sum_bound(x, w) + exact.abs() * U32 * 2
    assert ((got.double() - exact).abs() <= bound).all()


def test_layer_router_uses_tensor_cores_and_keeps_no_fp32_copy_of_x():
    torch.manual_seed(2)
    layer = MoKMoELayer(2048, 256, 64, 4, dtype=torch.bfloat16, device="cuda", backend="torch")
    x = torch.randn(4096, 2048, device="cuda").to(torch.bfloat16).requires_grad_(True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    logits = layer.router(x)
    kept = torch.cuda.memory_allocated() - base
    assert logits.grad_fn is not None and "TensorCoreLogits" in type(logits.grad_fn).__name__
    # what the forward keeps: the fp32 logits (plus allocator rounding), not a 4-byte copy of x (32 MiB)
    assert kept < logits.numel() * 4 + 2**20, kept
    exact = x.double() @ layer.router.weight.double().T
    assert ((logits.double() - exact).abs() <= _sum_bound(x, layer.router.weight)).all()
