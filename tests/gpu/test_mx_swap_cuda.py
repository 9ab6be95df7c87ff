"""mok_gemm_bk_mx_swap (kernels/mx_swapped.py, the weights as the wgmma's register A operand): on an sm_90 GPU,
against a float64 product of the dequantised weights within fp32 summation rounding, bitwise run after run, at
shapes with empty experts, one hot expert and a single token; and whether it has the bf16 kernel's bits (the
summation order inside a k16 step may differ with the operands' roles: reported, not required)."""

import pytest
import torch

from mok_nn import cuda_mx
from mok_nn.mxfp8 import quantize

cuda_ok = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not cuda_ok, reason="needs an sm_90 CUDA GPU")

CASES = [  # tokens, k, E, N, K, routing
    (128, 1, 1, 128, 128, "one_expert"),
    (1, 1, 4, 256, 128, "random"),
    (777, 2, 8, 384, 256, "skew"),  # empty experts
    (2000, 4, 16, 2048, 768, "random"),  # qwen3's down
    (500, 2, 4, 256, 512, "big_scales"),  # scale bytes above 134 in a quarter of the blocks (a second multiply)
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}k{}E{}N{}K{}-{}".format(*c))
def test_swapped_mx_gemm(case):
    from mok_nn import cuda_backend as cb

    T, k, E, N, K, mode = case
    g = torch.Generator(device="cuda").manual_seed(T + N)
    if mode == "one_expert":
        ids = torch.zeros(T, k, dtype=torch.int64, device="cuda")
    else:
        logits = torch.randn(T, E, device="cuda", generator=g)
        if mode == "skew":
            logits[:, E // 2:] -= 30
        ids = torch.topk(logits, k, dim=1).indices
    sched = cb.make_schedule(ids, E)
    a = torch.randn(sched.capacity, K, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(E, N, K, device="cuda", generator=g) * 2.0 ** torch.randint(
        -6, 7, (E, N, K // 32, 1), device="cuda", generator=g).float().repeat_interleave(32, -1).view(E, N, K)
    if mode == "big_scales":
        w = w * 2.0 ** (40 * (torch.rand(E, N, K // 32, 1, device="cuda", generator=g) < 0.25).float()
                        ).repeat_interleave(32, -1).view(E, N, K)
    q = quantize(w.to(torch.bfloat16), axis=-1)
    if mode == "big_scales":
        assert int(q.scale.max()) > 134 and int(q.scale.min()) <= 134
    mw = cuda_mx.MxWeight(q.data, q.scale)
    wq = mw.dequantized()
    out = torch.full((a.shape[0], N), float("nan"), dtype=torch.bfloat16, device="cuda")
    again = torch.full_like(out, float("nan"))
    cb.launch_gemm("mok_gemm_bk_mx_swap", a, mw.kernel_operands(), out, sched)
    cb.launch_gemm("mok_gemm_bk_mx_swap", a, mw.kernel_operands(), again, sched)
    rows = sched.pos.reshape(-1)
    assert torch.equal(out[rows].view(torch.int16), again[rows].view(torch.int16)), "not bitwise run to run"
    # float64 per expert: |out - exact| within one bf16 rounding plus fp32 summation over K
    ends = sched.seg_end.tolist()
    for e in range(E):
        n = int(sched.seg_rows[e])
        if n == 0:
            continue
        start = ends[e] - (-(-n // 128)) * 128
        exact = a[start:start + n].double() @ wq[e].double().t()
        got = out[start:start + n].double()
        bound = exact.abs() * 2.0**-8 + (a[start:start + n].double().abs() @ wq[e].double().abs().t()) * K * 2.0**-24
        assert bool(((got - exact).abs() <= bound).all()), (e, float((got - exact).abs().max()))
    want = cb.grouped_gemm(a, wq, sched, transpose_w=False)
    same = torch.equal(out[rows].view(torch.int16), want[rows].view(torch.int16))
    print(f"bitwise the bf16 kernel on W_q: {same}")
