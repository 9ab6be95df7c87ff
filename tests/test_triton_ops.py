"""mok_nn.triton_ops against the torch ops they replace, run by Triton's interpreter on the CPU (where Triton is
installed; tests/gpu/test_torch_backend_cuda.py runs the compiled kernels): fake_quantize bit for bit against
mxfp8.fake_quantize_fast (every bf16 bit pattern in blocks along either axis; fp32 and fp16 over wide scales with
NaN, inf and all-zero blocks, 3-D along the middle); the activation kernels within fp32 / bf16 rounding of the
portable backend's torch ops, every activation with and without a limit, rows longer than one step; topk_indices
against router.topk_by_sort (the stable sort): ties, NaN, +-0, +-inf, widths not a power of two, k up to the width."""

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":  # (tests/conftest.py sets it where there is no GPU)
    pytest.skip("on a GPU machine tests/gpu/test_torch_backend_cuda.py runs the compiled kernels", allow_module_level=True)
pytest.importorskip("triton")

from mok_nn import torch_backend, triton_ops  # noqa: E402
from mok_nn.mxfp8 import fake_quantize_fast  # noqa: E402


def _same(a, b):
    """Equal bits, NaN where NaN (a NaN's sign and payload unspecified)."""
    nan = torch.isnan(b)
    return torch.equal(torch.isnan(a), nan) and torch.equal(a[~nan], b[~nan]) and \
        torch.equal(torch.signbit(a[~nan]), torch.signbit(b[~nan]))


def test_every_bf16_bit_pattern_along_either_axis():
    every = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = every[torch.randperm(every.numel(), generator=torch.Generator().manual_seed(0))].reshape(64, 1024)
    for axis in (0, 1):
        assert _same(triton_ops.fake_quantize(x, axis), fake_quantize_fast(x, axis)), axis


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_wide_scales_and_special_values(dtype):
    g = torch.Generator().manual_seed(1)
    scale = torch.exp2(torch.randint(-140 if dtype == torch.float32 else -24, 14, (3, 64, 1), generator=g).float())
    y = (torch.randn(3, 64, 96, generator=g) * scale).to(dtype)
    y[0, 5, 7], y[1, 33, 2], y[2, :32, 0] = float("nan"), float("inf"), 0
    y[2, 32:64, 1] = 448 * 2.0**-3
    for axis in (1, 2):
        got = triton_ops.fake_quantize(y, axis)
        assert got.dtype == dtype and got.shape == y.shape
        assert _same(got, fake_quantize_fast(y, axis)), axis


def test_chooses_itself_only_on_cuda():
    assert not triton_ops.runs_on(torch.ones(32))


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


CASES = [("swiglu", None), ("swiglu", 1.5), ("swiglu_oai", 7.0), ("swiglu_oai", None)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("activation,limit", CASES)
def test_kernels_match_the_torch_ops(activation, limit, dtype):
    g = torch.Generator().manual_seed(0)
    n, inter = 37, 1100  # a row takes two steps of BLOCK_I
    gate_up = (3 * torch.randn(n, 2 * inter, generator=g)).to(dtype)
    dh_raw = torch.randn(n, inter, generator=g).to(dtype)
    w = torch.rand(n, generator=g)
    tol = 1e-6 if dtype == torch.float32 else 1e-2

    h = triton_ops.activation_forward(gate_up, activation, limit)
    h_ref = torch_backend._activation_forward(gate_up, activation, limit).to(dtype)
    assert h.dtype == dtype and _rel(h, h_ref) < tol

    dw, wh, dgu = triton_ops.mlp_backward_rows(gate_up, dh_raw, w, activation, limit, True)
    dw_ref, wh_ref, dgu_ref = torch_backend._mlp_backward_rows(None, w, gate_up, h_ref, dh_raw.clone(), None, None,
                                                               activation, limit, True)  # (updates its dh' in fp32)
    assert _rel(dw, dw_ref) < tol and _rel(wh, wh_ref) < tol and _rel(dgu, dgu_ref) < tol
    if limit is not None:  # no gradient through a clamped element, exactly
        g_, u_ = gate_up[:, :inter].float(), gate_up[:, inter:].float()
        assert (dgu[:, :inter][g_ > limit] == 0).all() and (dgu[:, inter:][u_.abs() > limit] == 0).all()
        assert (g_ > limit).any() and (u_.abs() > limit).any()
    # the h the backward kernel makes again is the forward kernel's, bit for bit (w h with w = 1 is h)
    assert torch.equal(triton_ops.mlp_backward_rows(gate_up, dh_raw, torch.ones(n), activation, limit, True)[1], h)
    _, none, dgu2 = triton_ops.mlp_backward_rows(gate_up, dh_raw, w, activation, limit, False)
    assert none is None and torch.equal(dgu2, dgu)
    # d gate_up into gate_up's own buffer (the portable backward where autograd keeps no graph): the same bits
    buf = gate_up.clone()
    dw3, wh3, dgu3 = triton_ops.mlp_backward_rows(buf, dh_raw, w, activation, limit, True, dgu_out=buf)
    assert dgu3 is buf and torch.equal(buf, dgu) and torch.equal(dw3, dw) and torch.equal(wh3, wh)
    with pytest.raises(ValueError, match="dgu_out"):
        triton_ops.mlp_backward_rows(gate_up, dh_raw, w, activation, limit, True, dgu_out=gate_up[:, :inter])


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("opts", [dict(), dict(activation="swiglu_oai", swiglu_limit=7.0, expert_proj_bias=True),
                                  dict(swiglu_limit=1.0)], ids=["plain", "oai_bias", "clamp"])
def test_the_portable_layer_with_the_kernels(monkeypatch, opts, precision):
    """The portable backend's layer with every step the kernels take (made to run on the CPU tensors here) against
    the same layer in torch ops: y and every gradient within bf16 rounding (with MXFP8, whose steps of 1/8 to 1/16
    move a value on either side of a bf16 rounding by a step, within 4e-2)."""
    from mok_nn import MoKMoELayer

    def run(kernels: bool):
        monkeypatch.setattr(triton_ops, "runs_on", lambda t: kernels and t.dtype != torch.float64)
        torch.manual_seed(0)
        layer = MoKMoELayer(64, 64, 8, 2, backend="torch", dtype=torch.bfloat16, precision=precision, **opts)
        with torch.no_grad():
            for name, p in layer.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.3)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(40, 64, generator=g).bfloat16().requires_grad_(True)
        y = layer(x)
        (y.float() * torch.randn(40, 64, generator=g)).sum().backward()
        return [y, x.grad] + [p.grad for p in layer.parameters()]

    with_kernels = run(True)
    assert triton_ops._VERDICTS and all(triton_ops._VERDICTS.values())  # the kernels ran: none fell back
    for a, b in zip(with_kernels, run(False)):
        assert _rel(a, b) < (1e-2 if precision == "bf16" else 4e-2)


@pytest.mark.parametrize("programs_slow", [False, True], ids=["fast_programs", "general_programs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "f32", "f16"])
def test_dequantize_every_e4m3_byte_at_every_scale(dtype, programs_slow):
    """triton_ops.dequantize against mxfp8.dequantize's torch ops bit for bit: every E4M3 byte (NaN, -0, subnormals)
    under every E8M0 scale byte (2**-127 up to 2**127 and NaN: results below the normal range, past fp32's), 3-D
    data along the last dimension; each scale in a program whose scales all lie in the kernel's fast range where
    it does (bf16 / fp32 build the bits directly there), and each in a program that takes the general way."""
    from helpers import every_e4m3_byte_at_every_scale
    from mok_nn.mxfp8 import MXFP8Tensor, _dequantize
    from mok_nn.triton_ops import kernels

    blocks = triton_ops.DEQUANTIZE_FORM[0]  # MXFP8 blocks per program
    data, scale = every_e4m3_byte_at_every_scale(programs_slow, blocks)
    per_program = scale[:, 0].int().split(blocks // 8)
    lo, hi = kernels.FAST_LO.value, kernels.FAST_HI.value
    fast = [bool(((p >= lo) & (p <= hi)).all()) for p in per_program]
    assert not any(fast) if programs_slow else sum(fast) >= len(fast) // 2  # both ways taken, every scale in each
    data, scale = data.reshape(1, -1, 256), scale.reshape(1, -1, 8)
    got = triton_ops.dequantize(data, scale, dtype)
    assert _same(got, _dequantize(MXFP8Tensor(data, scale, 2), dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "f32", "f16"])
def test_fake_quantize_rows_is_the_padded_copy_way(dtype):
    """triton_ops.fake_quantize_rows (the portable backend's weight-gradient operands: blocks of 32 rows of each
    expert, the last one short) bit for bit what Groups.quantize_rows computes in torch ops (a copy with every
    expert's rows zero-padded to blocks of 32, fake_quantize along the rows, the rows gathered back): experts
    without rows, with fewer than 32, with 32, with several blocks and a short last one; columns not a multiple of
    the program's 64; special values."""
    g = torch.Generator().manual_seed(7)
    counts = torch.tensor([0, 5, 32, 70, 0, 33, 1, 64])
    ids = torch.repeat_interleave(torch.arange(8), counts)
    groups = torch_backend.groups_from_sorted_ids(ids, 8, fused=True, capacity=ids.numel())
    scale = torch.exp2(torch.randint(-30, 30, (ids.numel(), 1), generator=g).float())
    rows = (torch.randn(ids.numel(), 100, generator=g) * scale).to(dtype)
    rows[3, 7], rows[40, 99], rows[100:110, 0] = float("nan"), float("inf"), 0
    got, want = groups._quantize_rows_both(rows)
    assert got.shape == rows.shape and _same(got, want)


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_mxfp8_only_layer_with_the_dequantize_kernel(monkeypatch, precision):
    """An MXFP8-only layer whose weights dequantise through the kernel (made to run on the CPU tensors here) computes
    bit for bit what it computes with the torch ops: y, d x, d router."""
    from mok_nn import MoKMoELayer

    def run(kernel: bool):
        monkeypatch.setattr(triton_ops, "dequantize_runs_on", lambda data, axis, dtype: kernel)
        torch.manual_seed(0)
        layer = MoKMoELayer(64, 64, 8, 2, backend="torch", dtype=torch.bfloat16, precision=precision,
                            mxfp8_experts=True)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(40, 64, generator=g).bfloat16().requires_grad_(True)
        y = layer(x)
        (y.float() * torch.randn(40, 64, generator=g)).sum().backward()
        return [y, x.grad, layer.router.weight.grad]

    with_kernel = run(True)
    assert any(k[0][0] == "dequantize" and ok for k, ok in triton_ops._VERDICTS.items())
    for a, b in zip(with_kernel, run(False)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("rows,cols,k", [(1, 8, 2), (37, 128, 8), (70, 60, 60), (5, 256, 20), (300, 16, 1)])
def test_topk_indices_is_the_stable_sort(rows, cols, k):
    from mok_nn.router import topk_by_sort

    g = torch.Generator().manual_seed(rows * cols + k)
    v = torch.randint(-3, 4, (rows, cols), generator=g).float() / 2  # many ties, -0 from the negation below
    v[::3] = torch.randn(v[::3].shape, generator=g)
    v[1::4, ::5] = -v[1::4, ::5]
    flat = v.view(-1)
    for value in (float("nan"), float("inf"), -float("inf"), -0.0, float("nan")):
        flat[torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)] = value
    got = triton_ops.topk_indices(v, k)
    assert got.dtype == torch.int64 and got.shape == (rows, k)
    assert torch.equal(got, topk_by_sort(v, k))


@pytest.mark.parametrize("score_func,norm,scale,bias,k,cols", [
    ("softmax", True, 1.0, False, 8, 128), ("softmax", False, 2.5, True, 2, 8), ("sigmoid", True, 2.5, True, 8, 60),
    ("sigmoid", False, 1.0, False, 4, 32), ("softmax", True, 1.0, True, 20, 256)])
def test_route_matches_the_torch_ops(score_func, norm, scale, bias, k, cols):
    """triton_ops.route against router.route_torch: the same ids, weights and scores within fp32 rounding, and the
    logits' gradient from both outputs' gradients."""
    from mok_nn.router import _route_forms, route_torch

    g = torch.Generator().manual_seed(cols + k)
    logits = torch.randn(77, cols, generator=g) * 3
    logits[5] = 0.0  # one row of exact ties: the lower experts
    b = 0.1 * torch.randn(cols, generator=g) if bias else None
    d_w = torch.randn(77, k, generator=g)
    # both forms, forward and backward from the same pseudo-random gradients of the weights and the scores
    (ids, w, s, dl), (ids_t, w_t, s_t, dl_t) = _route_forms(logits, k, score_func, norm, scale, b)
    assert torch.equal(ids, ids_t)
    for a, b_ in ((w, w_t), (s, s_t), (dl, dl_t)):
        assert _rel(a, b_) < 1e-6
    # only the weights' gradient (the layer without aux losses): d scores None
    x = logits.clone().requires_grad_(True)
    _, w, _ = triton_ops.route(x, k, score_func, norm, scale, b)
    (w * d_w).sum().backward()
    x2 = logits.clone().requires_grad_(True)
    _, w2, _ = route_torch(x2, k, score_func, norm, None, None, scale, b)
    (w2 * d_w).sum().backward()
    assert _rel(x.grad, x2.grad) < 1e-6


@pytest.mark.parametrize("score_func,norm,scale,logit_bias,sel_bias,k,cols,hidden,rows", [
    ("softmax", True, 1.0, False, False, 8, 128, 128, 77), ("sigmoid", False, 2.5, True, True, 4, 60, 96, 70),
    ("softmax", True, 1.0, True, True, 20, 128, 64, 33), ("softmax", False, 1.0, False, False, 1, 8, 40, 1)])
def test_fused_router_matches_the_two_steps(score_func, norm, scale, logit_bias, sel_bias, k, cols, hidden, rows):
    """router.route_tokens' one kernel (triton_ops.router_forward) against router_logits + route_torch: logits within
    fp32 rounding of float64, the same ids, weights and scores within fp32 rounding, d x and d w from the same
    output gradients. fp16 (the interpreter's dot of bf16 operands is wrong; tests/gpu/test_router_cuda.py runs
    bf16 on the GPU); hidden sizes that are not a multiple of the kernel's K step."""
    from mok_nn.router import _router_forms, route_torch

    g = torch.Generator().manual_seed(cols + k + hidden)
    x = torch.randn(rows, hidden, generator=g).half()
    w = (torch.randn(cols, hidden, generator=g) / hidden**0.5).half()
    lb = (0.1 * torch.randn(cols, generator=g)).half() if logit_bias else None
    sb = 0.1 * torch.randn(cols, generator=g) if sel_bias else None
    fused, steps = _router_forms(x, w, lb, k, score_func, norm, scale, sb)
    exact = x.double() @ w.double().T + (0 if lb is None else lb.double())
    assert _rel(fused[0], exact) < 1e-6
    assert torch.equal(fused[1], steps[1])
    for a, b in zip(fused[2:4], steps[2:4]):
        assert _rel(a, b) < 1e-6
    for a, b in zip(fused[4:], steps[4:]):
        assert a.dtype == torch.float16 and _rel(a, b) < 1e-3
    # only the weights' gradient (the layer without aux losses: the logits and scores unused)
    from mok_nn.router import _FusedRouter, router_logits

    d_w = torch.randn(rows, k, generator=g)
    grads = []
    for fused_form in (True, False):
        xs = x.clone().requires_grad_(True)
        if fused_form:
            _, _, wts, _ = _FusedRouter.apply(xs, w, lb, k, score_func, norm, scale, sb)
        else:
            _, wts, _ = route_torch(router_logits(xs, w, lb), k, score_func, norm, None, None, scale, sb)
        (d_x,) = torch.autograd.grad((wts * d_w).sum(), xs)
        grads.append(d_x)
    assert _rel(grads[0], grads[1]) < 1e-3


@pytest.mark.parametrize("form", [(64, 2), (256, 8)], ids=["64cols_2warps", "256cols_8warps"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_requantize_rows_is_dequantize_then_fake_quantize_along_n(dtype, form, monkeypatch):
    """triton_ops.requantize_rows bit for bit against the torch ops it replaces, fake_quantize_fast(dequantize(..),
    -2): every E4M3 byte (NaN ones included) under scale bytes from the extremes (0, tiny values flushed or
    subnormal in bf16; >= 248, fp32 overflow) to real weights' range, and an all-zero block; in a tile form whose
    programs split the 96 columns and in one whose single program masks most of its 256."""
    monkeypatch.setattr(triton_ops, "REQUANTIZE_FORM", form)
    from mok_nn.mxfp8 import MXFP8Tensor, dequantize

    g = torch.Generator().manual_seed(7)
    data = torch.randint(0, 256, (3, 64, 96), dtype=torch.uint8, generator=g)
    data[0, :32, 0] = 0
    scale = torch.randint(100, 140, (3, 64, 3), dtype=torch.uint8, generator=g)
    scale[1] = torch.randint(0, 256, (64, 3), dtype=torch.uint8, generator=g)  # every kind of scale
    scale[2, :, 0] = torch.tensor([0, 1, 2, 3, 10, 20, 247, 248, 250, 254, 255] * 6)[:64].to(torch.uint8)
    scale[0, 32:, 1] = torch.randint(0, 5, (32,), dtype=torch.uint8, generator=g)  # a block below bf16's normal range
    scale[0, :32, 2] = 8
    e4m3 = data.view(torch.float8_e4m3fn)
    want = fake_quantize_fast(dequantize(MXFP8Tensor(e4m3, scale, 2), dtype), -2)
    got = triton_ops.requantize_rows(e4m3, scale, dtype)
    assert got.dtype == dtype and _same(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_requantize_rows_of_real_weights_keeps_or_rounds_as_the_torch_ops(dtype, monkeypatch):
    """requantize_rows on MXFP8 weights quantised from Gaussian values (whose tiles mostly keep every value: the
    kernel stores the dequantised bits as they are) bit for bit against the torch ops; with, in some tiles, a value
    more than 2**14 below its column block's largest (it rounds: E4M3's subnormals at the new scale), a NaN block, an
    all-zero column block and -0."""
    from mok_nn.mxfp8 import MXFP8Tensor, dequantize, quantize

    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 96, 192, generator=g) * torch.exp2(torch.randint(-1, 2, (4, 96, 1), generator=g).float())
    w[1, 40, 70] = w[1, 40:72, 70].abs().max() * 2.0**-17  # tiny against its column block (rows 32-63)
    w[2, 5, 100] = w[2, 0:32, 100].abs().max() * 2.0**-15
    w[3, 64:96, 9] = 0.0
    w[3, 70, 9] = -0.0
    q = quantize(w.bfloat16(), axis=-1)
    q.data.view(torch.uint8)[0, 33, 150] = 0x7F  # an E4M3 NaN
    want = fake_quantize_fast(dequantize(MXFP8Tensor(q.data, q.scale, 2), dtype), -2)
    for form in (triton_ops.REQUANTIZE_FORM, (32, 4), (256, 8)):  # the shipped one, one block a program, one masked
        monkeypatch.setattr(triton_ops, "REQUANTIZE_FORM", form)
        assert _same(triton_ops.requantize_rows(q.data, q.scale, dtype), want), form
    unchanged = dequantize(MXFP8Tensor(q.data, q.scale, 2), dtype)  # most values stay; the tiny ones do not
    assert not _same(want, unchanged) and (want == unchanged).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_requantize_rows_at_the_edge_of_the_new_scales_grid(dtype, monkeypatch):
    """A value below E4M3's normal range at its column block's new scale 2**e, alone in a row block of zeros (so
    that the row-wise MXFP8 holds it exactly) among Gaussian weights: on the new grid (a multiple of 2**(e - 9)) it
    is kept, one step finer it rounds (2**(e - 10) ties to even, to 0; 3 * 2**(e - 10) to 2**(e - 8)); bit for bit
    against the torch ops, and those values checked by hand."""
    from mok_nn.mxfp8 import MXFP8Tensor, dequantize, quantize

    g = torch.Generator().manual_seed(11)
    w = torch.randn(5, 64, 128, generator=g).bfloat16()
    # (expert, row, col, v, want), v and want in units of 2**(e - 9): on the grid 1, 10 and 14 (the last two
    # normal), off it 0.5 and 1.5
    planted = [(0, 40, 70, 1.0, 1.0), (1, 3, 5, 10.0, 10.0), (2, 33, 127, 0.5, 0.0),
               (3, 62, 64, 1.5, 2.0), (4, 10, 31, 14.0, 14.0)]
    wants = []
    for b, r, c, v, want in planted:
        w[b, r, c // 32 * 32:c // 32 * 32 + 32] = 0.0
        column = dequantize(quantize(w[b].float(), axis=-1), torch.float32)[r // 32 * 32:r // 32 * 32 + 32, c]
        mant, exp = torch.frexp(column.abs().max())
        e = int(exp) - 1 - 8 + int(mant > 0.875)  # the rceil scale exponent of the column block
        w[b, r, c] = v * 2.0 ** (e - 9)
        wants.append(want * 2.0 ** (e - 9))
    q = quantize(w, axis=-1)
    want = fake_quantize_fast(dequantize(MXFP8Tensor(q.data, q.scale, 2), dtype), -2)
    assert [want[b, r, c].item() for b, r, c, _, _ in planted] == wants
    for form in (triton_ops.REQUANTIZE_FORM, (32, 4), (128, 2)):
        monkeypatch.setattr(triton_ops, "REQUANTIZE_FORM", form)
        assert _same(triton_ops.requantize_rows(q.data, q.scale, dtype), want), form


def test_mxfp8_only_backward_with_the_requantize_kernel(monkeypatch):
    """The backward of an MXFP8-only layer with precision="mxfp8" whose column-wise weight values come from
    requantize_rows (made to run on the CPU tensors here; checked against the two steps on its first use) computes
    bit for bit what it computes with the two steps: d x and d router."""
    from mok_nn import MoKMoELayer

    def run(kernel: bool):
        monkeypatch.setattr(triton_ops, "requantize_runs_on", lambda data, dtype: kernel)
        torch.manual_seed(0)
        layer = MoKMoELayer(64, 64, 8, 2, backend="torch", dtype=torch.bfloat16, precision="mxfp8", mxfp8_experts=True)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(40, 64, generator=g).bfloat16().requires_grad_(True)
        (layer(x).float() * torch.randn(40, 64, generator=g)).sum().backward()
        return [x.grad, layer.router.weight.grad]

    with_kernel = run(True)
    assert any(k[0][0] == "requantize_rows" and ok for k, ok in triton_ops._VERDICTS.items())
    for a, b in zip(with_kernel, run(False)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("softmax", [True, False])
def test_route_backward_parts_are_the_bf16_split_of_d_logits(softmax):
    """triton_ops.route_backward with an incoming d logits and parts=True: d logits equal to the kernel's own plus
    the incoming one (one fp32 add), and parts bit for bit router._bf16_parts of it, side by side (the router's
    backward GEMM operand), over values from 2^-30 to 2^30 and a value beyond bf16's range."""
    from mok_nn.router import _bf16_parts

    g = torch.Generator().manual_seed(11)
    rows, cols, k = 37, 64, 4
    scores = torch.softmax(torch.randn(rows, cols, generator=g), -1) if softmax else torch.rand(rows, cols, generator=g)
    ids = torch.stack([torch.randperm(cols, generator=g)[:k] for _ in range(rows)])
    d_w = torch.randn(rows, k, generator=g)
    d_in = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-30, 30, (rows, cols), generator=g).float())
    d_in[3, 5] = 3.4e38
    plain, no_parts = triton_ops.route_backward(scores, ids, d_w, None, k, softmax, True, 1.0)
    assert no_parts is None
    d_l, parts = triton_ops.route_backward(scores, ids, d_w, None, k, softmax, True, 1.0, d_logits_in=d_in, parts=True)
    assert torch.equal(d_l, plain + d_in)
    assert parts.dtype == torch.bfloat16 and parts.shape == (rows, 3 * cols)
    assert torch.equal(parts.view(torch.int16), torch.cat(_bf16_parts(d_l), dim=1).view(torch.int16))


def test_transposed_is_the_torch_transpose():
    """triton_ops.transposed ([E, R, C] -> [E, C, R], cuda_mx.scale_pairs' words) against torch's transpose, words
    across the 16-bit range (NaN patterns included: they are moved, not read as numbers), at sizes that are not
    multiples of its tile."""
    g = torch.Generator().manual_seed(5)
    for shape in ((2, 100, 7), (1, 64, 64), (3, 129, 70)):
        x = torch.randint(-2**15, 2**15, shape, generator=g, dtype=torch.int16)
        x.view(-1)[:2**10] = torch.arange(-2**15, 2**15, 64, dtype=torch.int16)
        got = triton_ops.transposed(x)
        assert got.is_contiguous() and torch.equal(got, x.transpose(1, 2)), shape


def test_mx_row_factors_are_the_torch_ops():
    """triton_ops.mx_row_factors (the row factors of cuda_mx.MxColumnWeight): (S + 120) << 7 transposed, against
    the torch ops, over every scale byte the dgrad kernels admit, at sizes that are not multiples of its tile."""
    from mok_nn import cuda_mx

    g = torch.Generator().manual_seed(4)
    for shape in ((2, 100, 7), (1, 64, 64), (3, 129, 70), (2, 96, 70)):
        scale = torch.randint(0, cuda_mx.COLUMN_MAX_SCALE + 1, shape, generator=g, dtype=torch.uint8)
        scale.view(-1)[: cuda_mx.COLUMN_MAX_SCALE + 1] = torch.arange(cuda_mx.COLUMN_MAX_SCALE + 1, dtype=torch.uint8)
        want = ((scale.to(torch.int16) + 120) << 7).transpose(1, 2)
        assert torch.equal(triton_ops.mx_row_factors(scale, cuda_mx.ROW_FACTOR_BIAS), want), shape
        assert torch.equal(cuda_mx._row_factors_torch(scale), want), shape
        if shape[1] % 32 == 0:  # with marks: factor [e, b, r] | marks[e, r // 32, b]
            marks = torch.randint(0, 4, (shape[0], shape[1] // 32, shape[2]), generator=g, dtype=torch.int16)
            marked = want | marks.repeat_interleave(32, dim=1).transpose(1, 2)
            assert torch.equal(triton_ops.mx_row_factors(scale, cuda_mx.ROW_FACTOR_BIAS, marks), marked), shape
            assert torch.equal(cuda_mx._row_factors_torch(scale, marks), marked), shape


def _quantize_pair(x):
    """(triton_ops.quantize's, mxfp8's torch ops') bytes and scales of x along its last dimension."""
    from mok_nn.mxfp8 import _quantize

    data, scale = triton_ops.quantize(x)
    want = _quantize(x, x.dim() - 1, 32, "rceil")
    return (data.view(torch.uint8), scale), (want.data.view(torch.uint8), want.scale)


def test_quantize_every_bf16_bit_pattern():
    """triton_ops.quantize (mxfp8.quantize on CUDA) against mxfp8's torch ops, byte for byte: every bf16 bit pattern
    (NaN and inf blocks, +-0, subnormals, the rceil boundary 1.75 * 2**p) in shuffled blocks, and blocks of one
    repeated pattern (a block of zeros, of -0, of subnormals only: the scale's lower clamp)."""
    every = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
    shuffled = every[torch.randperm(every.numel(), generator=torch.Generator().manual_seed(0))]
    repeated = every[torch.randperm(every.numel(), generator=torch.Generator().manual_seed(1))[:512]]
    x = torch.cat([shuffled, repeated.repeat_interleave(32)]).view(torch.bfloat16).reshape(-1, 256)
    (data, scale), (want_data, want_scale) = _quantize_pair(x)
    assert data.shape == x.shape and scale.shape == (x.shape[0], 8)
    assert torch.equal(scale, want_scale) and torch.equal(data, want_data)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_quantize_wide_scales_and_special_values(dtype):
    """As above for fp32 (blocks of fp32 subnormals and tiny normals: the integer path) and fp16, 3-D, a size
    that is not a multiple of a program's 64 blocks; values at 448 * 2**e (no saturation) and above."""
    g = torch.Generator().manual_seed(2)
    scale = torch.exp2(torch.randint(-149 if dtype == torch.float32 else -24, 14, (3, 37, 1), generator=g).float())
    y = (torch.randn(3, 37, 96, generator=g) * scale).to(dtype)
    y[0, 5, 7], y[1, 33, 2], y[2, :2, :32] = float("nan"), float("-inf"), 0
    y[2, 3, 32:64] = 448 * 2.0**-3
    y[2, 4, 0:32] = -(2.0**-149 if dtype == torch.float32 else 2.0**-24)
    (data, s), (want_data, want_s) = _quantize_pair(y)
    assert torch.equal(s, want_s) and torch.equal(data, want_data)
