"""The forward GEMMs that read MXFP8-only weights as MXFP8 (mok_gemm_bk_mx, mok_gemm_gate_up_swiglu_mx:
kernels/mx_swapped.py; cuda_mx.py) on an sm_90 GPU: bit for bit the bf16 kernels on W_q = dequantize(stored),
run after run, at shapes with partial tiles, empty experts and one expert taking every token, and with the
scale extremes (all-zero blocks, blocks at E4M3's top, NaN blocks, large and tiny scales); and the layer takes
them (launched kernels) with the bits of a layer holding W_q. Likewise the backward's dgrad GEMMs of
precision="mxfp8" (mok_gemm_bn_mxq[_f32]) against the bf16 kernel on W_q's values along K.
"""

import warnings

import pytest
import torch

from mok_nn import MoKMoELayer, cuda_mx, triton_ops
from mok_nn.mxfp8 import dequantize, quantize

cuda_ok = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not cuda_ok, reason="needs an sm_90 CUDA GPU")

CASES = [  # tokens, k, E, H (K of gate/up, N of down), I, routing
    (256, 2, 8, 512, 256, "random"),
    (1, 1, 4, 256, 128, "random"),
    (333, 2, 8, 384, 128, "skew"),  # H % 256 == 128: the down GEMM's last column tile half past N; empty experts
    (300, 2, 3, 64, 384, "one_expert"),  # K = 64 (one stage) for gate/up; expert 0 takes every token
    (200, 2, 4, 192, 320, "random"),  # odd stage counts (3, 5); the down GEMM's N = 192 ends inside a 128 tile
    (200, 2, 4, 192, 128, "skew"),  # gate/up + SwiGLU over 3 stages
    (2000, 4, 16, 2048, 768, "random"),  # qwen3's H and I
]


def _case_id(c):
    return "T{}k{}E{}H{}I{}-{}".format(*c)


def _routing(T, k, E, mode, g):
    if mode == "one_expert":
        return torch.arange(k, device="cuda").expand(T, k).contiguous()
    logits = torch.randn(T, E, device="cuda", generator=g)
    if mode == "skew":
        logits[:, E // 2:] -= 30
    return torch.topk(logits, k, dim=1).indices


def _mx_weight(E, N, K, g, extremes: bool) -> cuda_mx.MxWeight:
    """Random weights quantised along K; with extremes, some blocks all zero, some at E4M3's top (448 * 2**e),
    some tiny (scale bytes near 0), some huge (scale bytes above 134: two multiplies), one NaN block."""
    w = torch.randn(E, N, K, device="cuda", generator=g) / K**0.5
    if extremes:
        blocks = w.view(E, N, K // 32, 32)
        blocks[0, 0, 0] = 0.0
        blocks[0, 1, 0] = 448.0 * torch.sign(blocks[0, 1, 0])
        blocks[-1, 2, -1] *= 2.0**-100
        blocks[-1, 3, 0] *= 2.0**20
        if N > 4:
            blocks[0, 4, -1, 5] = float("nan")
    q = quantize(w.to(torch.bfloat16), axis=-1)
    return cuda_mx.MxWeight(q.data, q.scale)


def _rows(sched):
    """The routed rows. A segment's padding rows are left out: the bf16 kernels that skip all-padding row
    blocks give zeros there, while the MX kernels compute them from A's padding rows (random in hr)."""
    return sched.pos.reshape(-1)


def _bits(t):
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("extremes", [False, True], ids=["plain", "extremes"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_mx_gemms_are_the_bf16_kernels_on_w_q(case, extremes):
    from mok_nn import cuda_backend as cb

    T, k, E, H, I, mode = case
    g = torch.Generator(device="cuda").manual_seed(T + E + H)
    sched = cb.make_schedule(_routing(T, k, E, mode, g), E)
    x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    a = cb.gather_rows(x, sched)
    w13, w2 = _mx_weight(E, 2 * I, H, g, extremes), _mx_weight(E, H, I, g, extremes)
    rows = _rows(sched)

    # gate/up: the plain MX GEMM and the one with the activation epilogue against the bf16 forms on W_q
    gu = cb.gemm_mx(a, w13, sched)
    gu_again = cb.gemm_mx(a, w13, sched)
    want = cb.grouped_gemm(a, w13.dequantized(), sched, transpose_w=False)
    assert torch.equal(_bits(gu[rows]), _bits(want[rows]))
    assert torch.equal(_bits(gu[rows]), _bits(gu_again[rows]))
    if extremes and int(sched.seg_rows[0]):
        assert bool(gu[rows].isnan().any())  # the NaN block reaches expert 0's rows
    if I % 128 == 0:
        gate_up, h = cb.launch_gate_up_act(a, w13, sched, "swiglu", None)
        want_gu, want_h = cb.gate_up_act(a, w13.dequantized(), sched, "swiglu", None)
        assert torch.equal(_bits(gate_up[rows]), _bits(want_gu[rows]))
        assert torch.equal(_bits(h[rows]), _bits(want_h[rows]))
        _, h_again = cb.launch_gate_up_act(a, w13, sched, "swiglu", None)
        assert torch.equal(_bits(h[rows]), _bits(h_again[rows]))
        _, h_mx = cb.launch_gate_up_act(a, w13, sched, "swiglu", None, h_mx=True)  # MXFP8 values in the epilogue
        assert torch.equal(_bits(h_mx[rows]), _bits(cb.mx_values(want_h, cb.MX_ALONG_COLS)[rows]))

    # down: N = H (a half tile past N where H % 256 == 128), K = I
    hr = torch.randn(a.shape[0], I, device="cuda", generator=g).to(torch.bfloat16)
    out = cb.gemm_mx(hr, w2, sched)
    want = cb.grouped_gemm(hr, w2.dequantized(), sched, transpose_w=False)
    assert torch.equal(_bits(out[rows]), _bits(want[rows]))
    # against fp64 on the dequantised weights, for the real rows of the first expert (not a bf16 self-check)
    n0 = int(sched.seg_rows[0])
    if n0 and not extremes:
        ref = hr[:n0].double() @ w2.dequantized()[0].double().t()
        err = (out[:n0].double() - ref).norm() / ref.norm()
        assert err < 1e-2


def test_scale_pairs_and_operand_views_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(3)
    w = _mx_weight(4, 96, 256, g, extremes=False)
    b, pairs = w.kernel_operands()
    assert b.shape == (96, 256, 4) and b.stride() == (256, 1, 96 * 256) and b.dtype == torch.uint8
    assert pairs.shape == (96, 4, 4) and pairs.stride() == (1, 96, 96 * 4) and pairs.dtype == torch.uint16
    s = w.scale.long()
    want = s[..., 0::2] | (s[..., 1::2] << 8)  # [E, N, K / 64]
    assert torch.equal(pairs.view(torch.int16).long().permute(2, 0, 1) & 0xFFFF, want)
    assert triton_ops._VERDICTS[(("transposed", torch.int16), str(b.device))]  # (one Triton pass made them)


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_layer_forward_reads_mxfp8_weights_with_the_bits_of_w_q(precision, launched_kernels):
    """An MXFP8-only layer on the fused path runs the _mx kernels in its forward (no dequantisation kernel), and
    (precision="mxfp8") its backward's dgrad kernels; y, d x and the router's gradient are bitwise those of a layer
    holding W_q (with precision="mxfp8", d x and the router's gradient within fp32 summation order, see below),
    each bitwise run after run."""
    H, I, E, k, T = 512, 256, 16, 4, 700
    torch.manual_seed(0)
    mx = MoKMoELayer(H, I, E, k, backend="cuda", precision=precision, dtype=torch.bfloat16).cuda()
    dense = MoKMoELayer(H, I, E, k, backend="cuda", precision=precision, dtype=torch.bfloat16).cuda()
    dense.load_state_dict(mx.state_dict())
    mx.quantize_experts_()
    dense.quantize_experts_().dequantize_experts_()
    dense.experts.gate_up_proj.requires_grad_(False)
    dense.experts.down_proj.requires_grad_(False)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def step(layer):
        xx = x.clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        y = layer(xx)
        y.backward(dy)
        return y.detach(), xx.grad, layer.router.weight.grad

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a kernel failing its first-use check warns: that fails here
        launched_kernels.clear()
        a = step(mx)
        ran = list(launched_kernels)
        a2 = step(mx)
        b = step(dense)
    assert "mok_gemm_gate_up_swiglu_mx" in ran and "mok_gemm_bk_mx" in ran
    if precision == "mxfp8":  # the backward's dgrad GEMMs read the stored bytes too
        assert "mok_gemm_bn_mxq" in ran and "mok_gemm_bn_mxq_f32" in ran
    for name, u, v, w in zip(("y", "dx", "d router"), a, a2, b):
        assert torch.equal(u, v), name
        if precision == "bf16" or name == "y":
            assert torch.equal(u, w), name
        else:
            # the dgrad of down: mok_gemm_bn_mxq_f32 + the activation backward, where the layer holding W_q runs
            # it with the activation in the epilogue (mok_gemm_dact_*_ppc), whose d topk-weights sum in another
            # order (cuda_backend.dgrad_act) before their rounding to bf16: they, the router's gradient and its
            # part of d x differ by a bf16 step here and there (measured 1.5e-5 relative for d x); the routed
            # experts' d x rows are bitwise (test_dgrad_mx_cols_*)
            assert (u.float() - w.float()).norm() <= 1e-3 * w.float().norm(), name
    assert all(cuda_mx._VERDICTS.get((n, str(x.device))) for n in ("mok_gemm_bk_mx", "mok_gemm_gate_up_swiglu_mx"))


def _mx_column_weight(E, R, C, g, extremes: bool) -> cuda_mx.MxColumnWeight:
    """Random weights [E, R, C] quantised along C; with extremes (within cuda_mx.column_reason's scale range),
    rows scaled by 2**-1 .. 2**-12 (their small values round at the column blocks' scales), all-zero blocks (scale
    byte 0), a block at E4M3's top at the largest admitted scale and a tiny one (bf16 subnormal values)."""
    w = torch.randn(E, R, C, device="cuda", generator=g) / C**0.5
    if extremes:
        w = w * 2.0 ** -torch.randint(0, 13, (E, R, 1), device="cuda", generator=g).float()
        blocks = w.view(E, R, C // 32, 32)
        blocks[0, :32, 0] = 0.0
        blocks[0, 1, 0] = 448.0 * 2.0**7
        blocks[-1, 2, -1] = blocks[-1, 2, -1] * 2.0**-120
    q = quantize(w.to(torch.bfloat16), axis=-1)
    assert int(q.scale.max()) <= cuda_mx.COLUMN_MAX_SCALE
    if extremes:
        assert int(q.scale.max()) == cuda_mx.COLUMN_MAX_SCALE and int(q.scale.min()) == 0
    return cuda_mx.MxColumnWeight(q.data, q.scale)


@pytest.mark.parametrize("extremes", [False, True], ids=["plain", "extremes"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_dgrad_mx_cols_is_the_bf16_kernel_on_values_along_k(case, extremes):
    """mok_gemm_bn_mxq[_f32]: the backward's dgrad GEMMs on MXFP8-only weights with precision="mxfp8" give the
    bf16 kernel's bits on W_q's MXFP8 values along K (triton_ops.requantize_rows), run after run; d x (K = 2I,
    N = H) in bf16, d h (K = H, N = I) in fp32."""
    from mok_nn import cuda_backend as cb

    T, k, E, H, I, mode = case
    g = torch.Generator(device="cuda").manual_seed(T + E + H + 1)
    sched = cb.make_schedule(_routing(T, k, E, mode, g), E)
    rows = _rows(sched)
    m = sched.tile_expert.numel() * 128
    for (r, c), out_dtype in (((2 * I, H), torch.bfloat16), ((H, I), torch.float32)):
        w = _mx_column_weight(E, r, c, g, extremes)
        a = torch.randn(m, r, device="cuda", generator=g).to(torch.bfloat16)
        name = "mok_gemm_bn_mxq" + ("_f32" if out_dtype == torch.float32 else "")
        got = cb.gemm_mx_cols(a, w, sched, name, out_dtype)
        again = cb.gemm_mx_cols(a, w, sched, name, out_dtype)
        values = w.values()
        want = cb.grouped_gemm(a, values, sched, transpose_w=True, out_dtype=out_dtype)
        assert torch.equal(got[rows], want[rows]) and torch.equal(got[rows], again[rows])
        # the row factors came from the Triton kernel, which agreed with the torch ops on its first use
        assert triton_ops._VERDICTS[(("mx_row_factors", True), str(a.device))]
        changed = not torch.equal(values, dequantize(w, torch.bfloat16))
        if extremes:  # the requantisation changed some values: the test can tell the two apart
            assert changed
        # the kernel requantises the 32 x 32 blocks holding such values (kernels/mx_operand.py), and only those: a
        # small plain weight may hold none
        blocks = cuda_mx.rounding_blocks(w.data, w.scale)
        assert bool(blocks.any()) == changed and not bool(blocks.all())
        n0 = int(sched.seg_rows[0])
        if n0 and not extremes:  # against fp64 on the values, the first expert's real rows
            ref = a[:n0].double() @ values[0].double()
            err = (got[:n0].double() - ref).norm() / ref.norm()
            assert err < 1e-2
