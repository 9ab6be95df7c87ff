"""The portable backend (backend="torch") on CUDA: against the reference backend on the same GPU and against a
float64 CPU computation, every gradient, bf16 / fp16 / fp32 and precision="mxfp8"; bitwise run-to-run
determinism and deterministic-algorithms mode; experts without tokens and one token; no host synchronisation
(torch.cuda.set_sync_debug_mode("error")) where torch._grouped_mm has its fused kernel (bf16 on sm90 / sm100)."""

import pytest
import torch

from mok_nn import MoKMoELayer, torch_backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEV = "cuda"
OPTIONS = {
    "plain": dict(),
    "group_bias_sigmoid": dict(score_func="sigmoid", n_group=4, topk_group=2, use_expert_bias=True,
                               routed_scaling_factor=2.5),
    "oai_bias_shared": dict(activation="swiglu_oai", swiglu_limit=7.0, expert_proj_bias=True,
                            shared_intermediate_size=64, shared_expert_gate=True),
    "clamp": dict(swiglu_limit=1.5),
}


def _layer(backend, dtype, opts, seed=0, hidden=128, inter=64, experts=16, top_k=4, device=DEV, **kw):
    torch.manual_seed(seed)
    layer = MoKMoELayer(hidden, inter, experts, top_k, backend=backend, device=device, dtype=dtype, **opts, **kw)
    with torch.no_grad():  # biases random, not zero
        for name, p in layer.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
    return layer


def _run(layer, x, dy):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = layer(x)
    (y.float() * dy.float()).sum().backward()
    grads = {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    return y.detach(), grads


def _inputs(tokens, hidden, dtype, seed=1, device=DEV):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=dtype)
    dy = torch.randn(tokens, hidden, generator=g).to(device=device, dtype=dtype)
    return x, dy


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "f16", "f32"])
@pytest.mark.parametrize("opts", list(OPTIONS))
@pytest.mark.parametrize("tokens", [1, 77, 1024])
def test_matches_reference_backend_and_float64(opts, dtype, tokens):
    """Every output and gradient against the reference backend on the GPU (tolerance: a few ulps of the storage
    dtype, relative L2) and against a float64 CPU run of the reference backend on the same (rounded) state: within
    3 TOL, or no further from it than the reference backend in the same dtype is (with a clamp, an element within
    the dtype's rounding of the limit is clamped in one precision and not in the other, and its gradient jumps:
    both backends then differ from float64 alike)."""
    x, dy = _inputs(tokens, 128, dtype)
    y_t, g_t = _run(_layer("torch", dtype, OPTIONS[opts]), x, dy)
    y_r, g_r = _run(_layer("reference", dtype, OPTIONS[opts]), x, dy)
    ref64 = _layer("reference", torch.float64, OPTIONS[opts], device="cpu")
    ref64.load_state_dict({k: v.detach().cpu().double() if v.is_floating_point() and "correction" not in k
                           else v.detach().cpu() for k, v in _layer("torch", dtype, OPTIONS[opts]).state_dict().items()})
    y_64, g_64 = _run(ref64, x.cpu().double(), dy.cpu().double())
    assert _rel(y_t.cpu(), y_r.cpu()) < TOL[dtype]
    assert _rel(y_t.cpu(), y_64) < 3 * TOL[dtype]
    for name in g_r:
        assert g_t[name] is not None and g_t[name].dtype == dtype, name
        if g_64[name].abs().max() == 0:
            continue
        assert _rel(g_t[name].cpu(), g_r[name].cpu()) < TOL[dtype], name
        assert _rel(g_t[name].cpu(), g_64[name]) < max(3 * TOL[dtype], 1.5 * _rel(g_r[name].cpu(), g_64[name])), name


def test_experts_without_tokens():
    """64 experts, 3 tokens: the experts no token picks get exact zero gradients (grouped GEMM groups of no rows)."""
    layer = _layer("torch", torch.bfloat16, OPTIONS["oai_bias_shared"], experts=64, top_k=2)
    x, dy = _inputs(3, 128, torch.bfloat16)
    _, g = _run(layer, x, dy)
    used = set(layer.router_logits.topk(2).indices.reshape(-1).tolist())
    for name in ("experts.gate_up_proj", "experts.down_proj", "experts.gate_up_proj_bias", "experts.down_proj_bias"):
        nonzero = (g[name].reshape(64, -1).abs().sum(1) > 0).tolist()
        assert nonzero == [e in used for e in range(64)], name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_bitwise_deterministic_and_deterministic_mode(dtype, precision):
    layer = _layer("torch", dtype, OPTIONS["oai_bias_shared"], precision=precision)
    x, dy = _inputs(4096, 128, dtype)
    first = _run(layer, x, dy)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = [_run(layer, x, dy) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(before)
    for y, g in runs:
        assert torch.equal(y, first[0])
        for name in first[1]:
            assert torch.equal(g[name], first[1][name]), name


def test_mxfp8_matches_reference_backend():
    opts = OPTIONS["oai_bias_shared"]
    x, dy = _inputs(300, 128, torch.bfloat16)
    y_t, g_t = _run(_layer("torch", torch.bfloat16, opts, precision="mxfp8"), x, dy)
    y_r, g_r = _run(_layer("reference", torch.bfloat16, opts, precision="mxfp8"), x, dy)
    y_b, _ = _run(_layer("torch", torch.bfloat16, opts), x, dy)
    assert _rel(y_t, y_r) < 3e-2 and _rel(y_t, y_b) > 1e-3
    for name in g_r:
        assert _rel(g_t[name], g_r[name]) < 3e-2, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "f32", "f16"])
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_no_host_synchronisation(dtype, precision):
    """The routed experts' forward and backward at EP=1 (MoKFunction on the torch backend, routing computed
    before) under torch.cuda.set_sync_debug_mode("error"): any host synchronisation raises, except where
    torch._grouped_mm itself reads its offsets on the host (fp16 / fp32, or a GPU other than sm90 / sm100:
    grouped_mm_reads_offsets_on_host), which must then be the only reason it raises."""
    from mok_nn import functional
    from mok_nn.autograd import MoKFunction
    from mok_nn.router import route

    layer = _layer("torch", dtype, OPTIONS["oai_bias_shared"], precision=precision)
    x, dy = _inputs(512, 128, dtype)
    ids, w, _ = route(layer.router(x).detach(), layer.top_k)
    e = layer.experts
    ws = functional.get_workspace(hidden_size=128, intermediate_size=64, num_experts=16, top_k=4, device=DEV,
                                  dtype=dtype, backend="torch", activation=layer.activation,
                                  swiglu_limit=layer.swiglu_limit, precision=precision)
    params = [p.detach().clone().requires_grad_(True) for p in
              (e.gate_up_proj, e.down_proj, e.gate_up_proj_bias, e.down_proj_bias)]
    xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    MoKFunction.apply(xx, ww, *params, ids, ws).float().sum().backward()  # warm-up: caches, allocator
    torch.cuda.synchronize()
    syncs = torch_backend.grouped_mm_reads_offsets_on_host("cuda", x.device.index, dtype)
    if syncs:  # torch's per-group loop: let its reads pass, every other synchronisation still raises
        real = torch._grouped_mm
        grouped_calls = []

        def unchecked(*a, **kw):
            grouped_calls.append(1)
            torch.cuda.set_sync_debug_mode("default")
            try:
                return real(*a, **kw)
            finally:
                torch.cuda.set_sync_debug_mode("error")

        torch._grouped_mm = unchecked
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = MoKFunction.apply(xx, ww, *params, ids, ws)
        y.backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        if syncs:
            torch._grouped_mm = real
    torch.cuda.synchronize()
    assert not syncs or grouped_calls  # the exemption was used by the grouped GEMMs, not by something else


def _same_bits(a, b):
    nan = torch.isnan(b)
    return torch.equal(torch.isnan(a), nan) and torch.equal(a[~nan], b[~nan]) and \
        torch.equal(torch.signbit(a[~nan]), torch.signbit(b[~nan]))


def test_fake_quantize_on_cuda_is_bitwise_the_cpu_one():
    """triton_ops.fake_quantize compiled (the portable backend's MXFP8 operands) against mxfp8.fake_quantize on the
    CPU: every bf16 bit pattern along either axis; fp32 / fp16 over wide scales with NaN, inf, zero, subnormal and
    top-of-range blocks, 3-D along the middle axis; more blocks than one program takes. mxfp8.fake_quantize_fast
    then takes the kernel (its first-use check passed)."""
    from mok_nn import triton_ops
    from mok_nn.mxfp8 import fake_quantize

    fake_quantize_fast = triton_ops.fake_quantize

    assert triton_ops.runs_on(torch.ones(32, device=DEV, dtype=torch.bfloat16))
    every = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = every[torch.randperm(every.numel(), generator=torch.Generator().manual_seed(0))].reshape(64, 1024)
    for axis in (0, 1):
        assert _same_bits(fake_quantize_fast(x.to(DEV), axis).cpu(), fake_quantize(x, axis)), axis
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float16):
        scale = torch.exp2(torch.randint(-140 if dtype == torch.float32 else -24, 14, (5, 64, 1), generator=g).float())
        y = (torch.randn(5, 64, 96, generator=g) * scale).to(dtype)
        y[0, 5, 7], y[1, 33, 2], y[2, :32, 0], y[3, 32:64, 1] = float("nan"), float("inf"), 0, 448 * 2.0**-3
        for axis in (1, 2):
            assert _same_bits(fake_quantize_fast(y.to(DEV), axis).cpu(), fake_quantize(y, axis)), (dtype, axis)
    big = torch.randn(3008, 4096, generator=g).bfloat16()
    assert _same_bits(fake_quantize_fast(big.to(DEV), 0).cpu(), fake_quantize(big, 0))
    from mok_nn import mxfp8

    assert _same_bits(mxfp8.fake_quantize_fast(x.to(DEV), 1).cpu(), fake_quantize(x, 1))
    assert all(ok for k, ok in triton_ops._VERDICTS.items() if k[0][0] == "fake_quantize")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("low", [-111, -104])
def test_fake_quantize_float_form_at_its_edge(dtype, low):
    """The kernels' float form (tiles whose blocks all have a scale exponent e >= -116) and their exact form (a
    tile holding a block below) against mxfp8.fake_quantize on the CPU: block scales around e = -116, elements
    down to 2**-131 (subnormal), blocks topped by 448 * 2**e; along either axis (both kernels)."""
    from mok_nn import triton_ops
    from mok_nn.mxfp8 import fake_quantize

    g = torch.Generator().manual_seed(3 - low)
    e = torch.randint(low, low + 6, (256, 8), generator=g).repeat_interleave(32, 1).float()
    x = torch.randn(256, 256, generator=g) * torch.exp2(e) * torch.exp2(torch.randint(-20, 1, (256, 256), generator=g))
    x[::7, ::32] = 448 * torch.exp2(e[::7, ::32] - 8)
    x = x.to(dtype)
    for axis in (0, 1):
        assert _same_bits(triton_ops.fake_quantize(x.to(DEV), axis).cpu(), fake_quantize(x, axis)), axis


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=["bf16", "f32", "f16"])
def test_dequantize_on_cuda_is_bitwise_the_cpu_one(dtype):
    """triton_ops.dequantize compiled (MXFP8-only expert weights, every call) against the CPU's torch ops: every E4M3
    byte under every E8M0 scale byte (results below the normal range rounded once), in programs whose scales all lie
    in the kernel's fast range (bf16 / fp32: the bits built directly) and in programs that go the general way;
    mxfp8.dequantize on CUDA then takes the kernel (its first-use check passed)."""
    from layer_runs import load_cpu_test
    from mok_nn import triton_ops
    from mok_nn.mxfp8 import MXFP8Tensor, dequantize

    for slow in (False, True):
        data, scale = load_cpu_test("helpers").every_e4m3_byte_at_every_scale(slow, triton_ops.DEQUANTIZE_FORM[0])
        data, scale = data.reshape(1, -1, 256), scale.reshape(1, -1, 8)
        want = dequantize(MXFP8Tensor(data, scale, 2), dtype)
        assert _same_bits(triton_ops.dequantize(data.to(DEV), scale.to(DEV), dtype).cpu(), want), slow
        assert _same_bits(dequantize(MXFP8Tensor(data.to(DEV), scale.to(DEV), 2), dtype).cpu(), want), slow
    assert triton_ops._VERDICTS[(("dequantize", dtype), "cuda:0")]


def test_router_topk_kernel_is_the_stable_sort():
    """triton_ops.topk_indices compiled, against router.topk_by_sort on the GPU: ties, NaN, +-0, +-inf; the layer's
    selection takes it (not dropped by its first-use check)."""
    from mok_nn import router, triton_ops

    g = torch.Generator(device="cuda").manual_seed(5)
    for rows, cols, k in ((8192, 128, 8), (333, 256, 8), (70, 60, 20), (4096, 8, 2)):
        v = torch.randint(-3, 4, (rows, cols), device="cuda", generator=g).float() / 2
        v[::3] = torch.randn(v[::3].shape, device="cuda", generator=g)
        v[1::4, ::5] = -v[1::4, ::5]
        flat = v.view(-1)
        for value in (float("nan"), float("inf"), -float("inf"), -0.0):
            flat[torch.randint(0, flat.numel(), (flat.numel() // 50,), device="cuda", generator=g)] = value
        assert torch.equal(triton_ops.topk_indices(v, k), router.topk_by_sort(v, k)), (rows, cols, k)
        assert torch.equal(router.stable_topk_indices(v, k), router.topk_by_sort(v, k))
        assert triton_ops._VERDICTS[(("topk_indices", k), str(v.device))]


@pytest.mark.parametrize("score_func,norm,scale,bias,k,cols", [
    ("softmax", True, 1.0, False, 8, 128), ("softmax", True, 1.0, False, 2, 8), ("sigmoid", True, 2.5, True, 8, 256),
    ("softmax", False, 1.0, True, 4, 32)])
def test_fused_route_matches_the_torch_ops(score_func, norm, scale, bias, k, cols):
    """triton_ops.route compiled, against router.route_torch on the GPU (8192 tokens): ids equal (random logits,
    one row of exact ties), weights, scores and the logits' gradient within fp32 rounding; router.route takes it."""
    from mok_nn import router

    g = torch.Generator(device="cuda").manual_seed(cols + k)
    logits = torch.randn(8192, cols, device="cuda", generator=g) * 3
    logits[5] = 0.0
    b = 0.1 * torch.randn(cols, device="cuda", generator=g) if bias else None
    # both forms, forward and backward from the same pseudo-random gradients of the weights and the scores
    (ids, w, s, dl), (ids_t, w_t, s_t, dl_t) = router._route_forms(logits, k, score_func, norm, scale, b)
    assert torch.equal(ids, ids_t)
    for a, b_ in ((w, w_t), (s, s_t), (dl, dl_t)):
        assert ((a - b_).norm() / b_.norm()).item() < 1e-6
    ids2, w2, _ = router.route(logits, k, score_func, norm, None, None, scale, b)
    assert torch.equal(ids2, ids) and torch.equal(w2, w)  # router.route took the kernel: the same bits


@pytest.mark.parametrize("activation,limit", [("swiglu", None), ("swiglu_oai", 7.0)])
def test_backward_rows_kernel_in_place_and_its_h(activation, limit):
    """triton_ops.mlp_backward_rows writing d gate_up over gate_up (the portable backward where autograd keeps no
    graph) gives the bits of its separate output; the h it makes again is the forward kernel's."""
    from mok_nn import triton_ops

    g = torch.Generator(device="cpu").manual_seed(5)
    n, inter = 300, 1100
    gate_up = (3 * torch.randn(n, 2 * inter, generator=g)).bfloat16().to(DEV)
    dh_raw = torch.randn(n, inter, generator=g).bfloat16().to(DEV)
    w = torch.rand(n, generator=g).to(DEV)
    dw, wh, dgu = triton_ops.mlp_backward_rows(gate_up, dh_raw, w, activation, limit, True)
    buf = gate_up.clone()
    dw2, wh2, dgu2 = triton_ops.mlp_backward_rows(buf, dh_raw, w, activation, limit, True, dgu_out=buf)
    assert dgu2 is buf and torch.equal(buf, dgu) and torch.equal(dw2, dw) and torch.equal(wh2, wh)
    # the h it makes again from gate_up is the forward kernel's, bit for bit (w h with w = 1 is h)
    h = triton_ops.activation_forward(gate_up, activation, limit)
    assert torch.equal(triton_ops.mlp_backward_rows(gate_up, dh_raw, torch.ones_like(w), activation, limit, True)[1], h)



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_fake_quantize_rows_kernel_is_the_cpu_torch_ops(dtype):
    """triton_ops.fake_quantize_rows compiled (the weight-gradient operands of precision="mxfp8": blocks of 32 rows
    of each expert) against Groups.quantize_rows's torch ops on the CPU, bit for bit; experts without rows, short
    and several blocks; on CUDA quantize_rows then takes the kernel (its first-use check passed)."""
    from mok_nn import triton_ops

    g = torch.Generator(device="cpu").manual_seed(7)
    counts = torch.tensor([0, 5, 32, 70, 0, 33, 1, 640])
    ids = torch.repeat_interleave(torch.arange(8), counts)
    scale = torch.exp2(torch.randint(-30, 30, (ids.numel(), 1), generator=g).float())
    rows = (torch.randn(ids.numel(), 200, generator=g) * scale).to(dtype)
    rows[3, 7], rows[40, 99] = float("nan"), float("inf")
    want = torch_backend.groups_from_sorted_ids(ids, 8, fused=True, capacity=ids.numel()).quantize_rows(rows)
    groups = torch_backend.groups_from_sorted_ids(ids.to(DEV), 8, fused=True, capacity=ids.numel())
    got = triton_ops.fake_quantize_rows(rows.to(DEV), *groups._mx_row_blocks(ids.numel(), torch.device(DEV)))
    assert _same_bits(got.cpu(), want)
    assert _same_bits(groups.quantize_rows(rows.to(DEV)).cpu(), want)
    assert triton_ops._VERDICTS[(("fake_quantize_rows", dtype), "cuda:0")]


def test_launcher_reuses_each_compiled_form_with_tritons_results():
    """triton_ops._Launcher: the second launch of a form runs the compiled kernel without Triton's launcher, with the
    results of Triton's own launch; an argument of a new form (1 row: an integer 1; a misaligned tensor) compiles
    its own."""
    from mok_nn import router, triton_ops

    launcher = triton_ops._kernels().topk_kernel
    assert launcher.fast
    g = torch.Generator(device="cuda").manual_seed(5)
    for rows in (1024, 1024, 1, 1, 33):
        v = torch.randn(rows, 128, device="cuda", generator=g)
        assert torch.equal(triton_ops.topk_indices(v, 8), router.topk_by_sort(v, 8)), rows
    forms = len(launcher.compiled)
    assert forms >= 3  # 1024 rows (a multiple of 16), 1 row, 33 rows: three integer forms
    assert launcher.fast_launches >= 2  # the second 1024 and the second 1
    flat = torch.randn(1 + 64 * 128, device="cuda", generator=g)
    v = flat[1:].view(64, 128)  # 4 bytes past a 16-byte boundary
    out = torch.empty(64, 8, dtype=torch.int64, device="cuda")
    fast = launcher.fast_launches
    for _ in range(2):
        out.fill_(-1)
        launcher[(16,)](v, out, 64, 128, K=8, ROWS=4, BLOCK=128)
        assert torch.equal(out, router.topk_by_sort(v, 8))
    assert len(launcher.compiled) == forms + 1 and launcher.fast_launches == fast + 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_requantize_rows_compiled_is_the_two_steps(dtype, monkeypatch):
    """triton_ops.requantize_rows compiled, bit for bit against dequantize + fake_quantize along N in torch ops on
    the CPU (random bytes under every kind of scale, and weights quantised from Gaussian values, which mostly keep
    their values; qwen3-like weights' shape), and the backward of MXFP8-only weights takes it."""
    from mok_nn import triton_ops
    from mok_nn.mxfp8 import MXFP8Tensor, dequantize, fake_quantize, quantize

    def on_cpu(t, axis):  # the oracle: fake_quantize's torch ops on the CPU
        return fake_quantize(t.cpu(), axis).to(t.device)

    g = torch.Generator(device="cuda").manual_seed(8)
    data = torch.randint(0, 256, (4, 1536, 2048), dtype=torch.uint8, device="cuda", generator=g)
    scale = torch.randint(110, 135, (4, 1536, 64), dtype=torch.uint8, device="cuda", generator=g)
    scale[1] = torch.randint(0, 256, (1536, 64), dtype=torch.uint8, device="cuda", generator=g)
    scale[2, :64] = torch.randint(0, 5, (64, 64), dtype=torch.uint8, device="cuda", generator=g)
    e4m3 = data.view(torch.float8_e4m3fn)
    want = on_cpu(dequantize(MXFP8Tensor(e4m3, scale, 2), dtype), -2)
    assert _same_bits(triton_ops.requantize_rows(e4m3, scale, dtype), want)
    # weights quantised from Gaussian values: most tiles keep their values (the kernel's common path), a few round
    w = torch.randn(4, 1536, 2048, device="cuda", generator=g)
    w[0, 100, 7] = w[0, 96:128, 7].abs().max() * 2.0**-16
    q = quantize(w.bfloat16(), axis=-1)
    want = on_cpu(dequantize(MXFP8Tensor(q.data, q.scale, 2), dtype), -2)
    for form in (triton_ops.REQUANTIZE_FORM, (128, 4)):
        monkeypatch.setattr(triton_ops, "REQUANTIZE_FORM", form)
        assert _same_bits(triton_ops.requantize_rows(q.data, q.scale, dtype), want), form
    monkeypatch.undo()  # the layer below: the shipped form
    layer = MoKMoELayer(256, 128, 8, 2, dtype=torch.bfloat16, device="cuda", precision="mxfp8").quantize_experts_()
    x = torch.randn(100, 256, device="cuda").to(torch.bfloat16).requires_grad_(True)
    layer(x).float().square().sum().backward()
    assert triton_ops._VERDICTS[(("requantize_rows", torch.bfloat16), "cuda:0")]
