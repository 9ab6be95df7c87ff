"""router.router_logits on CPU (the fp32-cast form) and the exact bf16 split its CUDA backward uses."""

import torch

from mok_nn import MoKMoELayer
from mok_nn import router as routing


def test_bf16_parts_sum_to_d_exactly():
    torch.manual_seed(0)
    d = torch.randn(512, 64) * torch.exp(torch.randn(512, 64) * 12)  # magnitudes over many binades
    hi, mid, lo = routing._bf16_parts(d)
    assert hi.dtype == mid.dtype == lo.dtype == torch.bfloat16
    assert torch.equal(hi.double() + mid.double() + lo.double(), d.double())
    assert (mid != 0).any() and (lo != 0).any()  # fp32 values need all three parts


def test_bf16_parts_keep_non_finite_values_in_the_high_part():
    d = torch.tensor([float("inf"), float("-inf"), float("nan"), 3.4e38, -1.5])
    hi, mid, lo = routing._bf16_parts(d)
    assert torch.isinf(hi[0]) and hi[0] > 0 and torch.isinf(hi[1]) and hi[1] < 0 and torch.isnan(hi[2])
    assert torch.isinf(hi[3])  # above bf16's largest finite value
    assert not mid[:4].any() and not lo[:4].any()
    assert hi[4] == -1.5 and mid[4] == 0 and lo[4] == 0


def test_cpu_logits_are_the_fp32_cast_gemm_with_bias():
    torch.manual_seed(1)
    x = torch.randn(33, 96).to(torch.bfloat16)
    w = torch.randn(8, 96).to(torch.bfloat16)
    b = torch.randn(8).to(torch.bfloat16)
    assert not routing._tensor_core_logits_run_on(x, w)
    got = routing.router_logits(x, w, b)
    assert got.dtype == torch.float32
    exact = x.double() @ w.double().T + b.double()
    # fp32 sums of 96 exact products, then the bias: within 96 u sum |x w| + u |logit|
    bound = 96 * 2.0**-24 * (x.double().abs() @ w.double().abs().T) + 2.0**-24 * exact.abs() * 2
    assert ((got.double() - exact).abs() <= bound).all()


def test_layer_routes_through_the_router_module_only_where_calling_it_would_do_more():
    """MoKMoELayer routes with router.route_tokens (its fused kernel on CUDA) for its own Router, and calls the
    router module where that runs something else: a forward or backward hook (the module's or a global one), a
    subclass (the HF integration's router_dtype), a forward replaced on the instance. The hook sees the logits."""
    from mok_nn.layer import Router, _plain_router

    torch.manual_seed(0)
    layer = MoKMoELayer(32, 16, 8, 2)
    assert _plain_router(layer.router)
    seen = []
    for register in (layer.router.register_forward_hook, layer.router.register_full_backward_hook,
                     torch.nn.modules.module.register_module_forward_pre_hook):
        handle = register(lambda *args: seen.append(register))
        assert not _plain_router(layer.router)
        handle.remove()
        assert _plain_router(layer.router)
    layer.router.forward = lambda x2d: Router.forward(layer.router, x2d)
    assert not _plain_router(layer.router)
    del layer.router.forward
    layer.router.__class__ = type("RouterInDtype", (Router,), {})
    assert not _plain_router(layer.router)
    layer.router.register_forward_hook(lambda mod, inp, out: seen.append(out))
    layer(torch.randn(5, 32).to(layer.router.weight.dtype))
    assert torch.equal(seen[-1], layer.router_logits)
