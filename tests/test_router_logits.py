"""router.router_logits on CPU (the fp32-cast form) and the exact bf16 split its CUDA backward uses."""

import torch

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
