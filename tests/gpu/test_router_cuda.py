"""The router logits on CUDA: one tensor-core GEMM with an fp32 output for bf16 / fp16 x and weights
(router.router_logits), against a float64 evaluation of the same products."""

import pytest
import torch

from mok_nn import MoKMoELayer
from mok_nn import router as routing

U32 = 2.0**-24  # fp32 unit roundoff


def _sum_bound(a, b):
    """Elementwise bound on fp32 sums of the K exact products a[i, k] b[k, j]: blocked summation with at most
    K / 16 sequential additions of partial sums (k = 16 per 16-bit tensor-core step), each partial sum a tree of
    depth at most 8, and a factor 2 for tensor cores' truncating adds: c u sum_k |a b|, c = 2 (K / 16 + 8).
    A 16-bit rounding anywhere on the way (2^-9 relative or more) is far outside it."""
    c = 2 * (a.shape[1] / 16 + 8)
    return c * U32 * (a.double().abs() @ b.double().abs())


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
    bound = _sum_bound(x, w.T)
    assert (err <= bound).all(), f"max err/bound {(err / bound).max().item():.3g}"
    if dtype == torch.bfloat16:  # and the bound excludes a bf16-rounded result (fp16's 2^-11 can fall inside it)
        rounded = (exact.to(dtype).double() - exact).abs()
        assert (rounded > bound).any()


def test_bf16_parts_are_exact():
    torch.manual_seed(3)
    d = torch.randn(4096, 128, device="cuda") * torch.exp(torch.randn(4096, 128, device="cuda") * 8)
    hi, mid, lo = routing._bf16_parts(d)
    assert hi.dtype == mid.dtype == lo.dtype == torch.bfloat16
    assert torch.equal(hi.double() + mid.double() + lo.double(), d.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bias_and_backward_against_float64(dtype):
    torch.manual_seed(1)
    t, h, e = 1000, 2048, 128
    x = torch.randn(t, h, device="cuda").to(dtype).requires_grad_(True)
    w = (torch.randn(e, h, device="cuda") / h**0.5).to(dtype).requires_grad_(True)
    b = torch.randn(e, device="cuda").to(dtype).requires_grad_(True)
    d = torch.randn(t, e, device="cuda")
    got = routing.router_logits(x, w, b)
    grads = torch.autograd.grad(got, (x, w, b), d)
    again = torch.autograd.grad(routing.router_logits(x, w, b), (x, w, b), d)
    assert all(torch.equal(u, v) for u, v in zip(grads, again)), "backward not bitwise reproducible"
    gx, gw, gb = grads
    # d x and d w: fp32 sums of exact products (bf16: of the three bf16 parts of d), rounded once to the dtype
    # (with d in its bf16 high part alone, d w's error would be about 2^-9 sum_t |d x|, some 25x the bound here)
    u16 = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11  # unit roundoff of the dtype
    for g, a, bb in ((gx, d, w.detach()), (gw, d.T, x.detach())):
        exact = a.double() @ bb.double()
        assert g.dtype == dtype
        err = (g.double() - exact).abs()
        bound = exact.abs() * u16 * 1.01 + _sum_bound(a, bb) * 4  # one rounding to the dtype; three parts
        assert (err <= bound).all(), f"max err/bound {(err / bound).max().item():.3g}"
    exact = d.double().sum(0)
    assert ((gb.double() - exact).abs() <= exact.abs() * u16 * 1.01 + t * U32 * d.double().abs().sum(0)).all()
    # logits with the bias: fp32 logits plus the bias, against float64
    exact = x.double() @ w.double().T + b.double()
    bound = _sum_bound(x, w.T) + exact.abs() * U32 * 2
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
    assert ((logits.double() - exact).abs() <= _sum_bound(x, layer.router.weight.T)).all()


def _route_tokens_case(dtype, t, h, e, k, logit_bias, sel_bias, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, device="cuda", generator=g).to(dtype).requires_grad_(True)
    w = (torch.randn(e, h, device="cuda", generator=g) / h**0.5).to(dtype).requires_grad_(True)
    lb = (0.1 * torch.randn(e, device="cuda", generator=g)).to(dtype).requires_grad_(True) if logit_bias else None
    sb = 0.1 * torch.randn(e, device="cuda", generator=g) if sel_bias else None
    grads = [torch.randn(t, e, device="cuda", generator=g), None,
             torch.randn(t, k, device="cuda", generator=g), torch.randn(t, e, device="cuda", generator=g)]
    return x, w, lb, sb, grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t,h,e,k,score_func,norm,scale,logit_bias,sel_bias", [
    (8192, 2048, 128, 8, "softmax", True, 1.0, False, False), (777, 1000, 60, 4, "sigmoid", False, 2.5, True, True),
    (300, 7168, 128, 8, "softmax", True, 1.0, False, True), (1, 256, 8, 2, "softmax", False, 1.0, True, False)])
def test_fused_router_against_float64_and_the_two_steps(dtype, t, h, e, k, score_func, norm, scale, logit_bias,
                                                        sel_bias):
    """route_tokens' one kernel: logits within fp32 summation rounding of a float64 evaluation, the routing of those
    logits as route's torch ops compute it (the same ids), d x and d w against float64 products of the torch ops'
    d logits, and every output and gradient bitwise the same on a second run."""
    x, w, lb, sb, grads = _route_tokens_case(dtype, t, h, e, k, logit_bias, sel_bias, t + e)
    params = (x, w) + ((lb,) if lb is not None else ())

    def run():
        out = routing.route_tokens(x, w, lb, k, score_func, norm, None, None, scale, sb)
        assert "FusedRouter" in type(out[0].grad_fn).__name__
        live = [(o, d) for o, d in zip(out, grads) if d is not None]
        return out, torch.autograd.grad([o for o, _ in live], params, [d for _, d in live])

    (logits, ids, wts, scores), got = run()
    (logits2, ids2, wts2, scores2), got2 = run()
    for a, b in zip((logits, ids, wts, scores) + got, (logits2, ids2, wts2, scores2) + got2):
        assert torch.equal(a, b), "not bitwise reproducible"
    exact = x.double() @ w.double().T + (0 if lb is None else lb.double())
    bound = _sum_bound(x, w.T) + exact.abs() * U32 * 2
    assert ((logits.double() - exact).abs() <= bound).all()
    # the routing of these logits by the torch ops, and their d logits from the same output gradients
    lt = logits.detach().clone().requires_grad_(True)
    ids_t, wts_t, scores_t = routing.route_torch(lt, k, score_func, norm, None, None, scale, sb)
    assert torch.equal(ids, ids_t)
    for a, b in ((wts, wts_t), (scores, scores_t)):
        assert ((a - b).norm() <= 1e-6 * b.norm()).item()
    (d_l,) = torch.autograd.grad((lt * grads[0]).sum() + (wts_t * grads[2]).sum() + (scores_t * grads[3]).sum(), lt)
    u16 = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    for g, a, b in ((got[0], d_l, w.detach()), (got[1], d_l.T, x.detach())):
        exact = a.double() @ b.double()
        # one rounding to the dtype, fp32 sums (three bf16 parts), the two d logits' fp32 difference (1e-6 relative)
        bound = exact.abs() * u16 * 1.01 + _sum_bound(a, b) * 4 + 1e-6 * (a.double().abs() @ b.double().abs())
        assert g.dtype == dtype and ((g.double() - exact).abs() <= bound).all()
    if lb is not None:
        exact = d_l.double().sum(0)
        assert ((got[2].double() - exact).abs() <= exact.abs() * u16 * 1.01 + 1e-5 * d_l.double().abs().sum(0)).all()


def test_layer_takes_the_fused_router_unless_the_router_is_hooked():
    torch.manual_seed(4)
    layer = MoKMoELayer(512, 128, 32, 4, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(300, 512, device="cuda").to(torch.bfloat16)
    layer(x)
    assert "FusedRouter" in type(layer.router_logits.grad_fn).__name__
    seen = []
    handle = layer.router.register_forward_hook(lambda mod, inp, out: seen.append(out))
    y_hooked = layer(x)
    handle.remove()
    assert len(seen) == 1 and "TensorCoreLogits" in type(layer.router_logits.grad_fn).__name__
    y = layer(x)
    assert ((y.float() - y_hooked.float()).norm() <= 1e-2 * y_hooked.float().norm()).item()
    wide = MoKMoELayer(512, 128, 256, 8, dtype=torch.bfloat16, device="cuda")  # above ROUTER_MAX_COLS: two steps
    wide(x)
    assert "TensorCoreLogits" in type(wide.router_logits.grad_fn).__name__
