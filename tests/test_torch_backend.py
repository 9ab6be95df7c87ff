"""The portable backend (backend="torch") on CPU: against the float64 oracle and the reference backend on fresh
random inputs, forward and every gradient, for every routing and activation option; bitwise run-to-run
determinism; deterministic-algorithms mode; fp32 / bf16 / fp16 (torch._grouped_mm) and float64 / unaligned
sizes (the padded batched GEMM); precision="mxfp8"; experts without tokens, one token, no token; no host
synchronisation (every aten op of a forward + backward is recorded)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import (ACTIVATIONS, H, ROUTINGS, assert_close, layer_forward_backward, make_layer,
                     oracle_forward_backward, random_x, single_thread)  # noqa: F401
from mok_nn import reference, torch_backend

T = 13
# As tests/test_layer.py: float64 differs from the oracle only in the order of sums; fp32 by a few ulps.
TOL = {torch.float64: 1e-12, torch.float32: 5e-6}
MIN_MARGIN = 1e-5


def _against_oracle(opts, dtype, shape, seed, **size):
    layer = make_layer(opts, dtype=dtype, seed=seed, backend="torch", **size)
    x = random_x(shape, dtype, seed + 1)
    dy = random_x(shape, dtype, seed + 2)
    y, grads = layer_forward_backward(layer, x, dy)
    res, ref_grads = oracle_forward_backward(layer, opts, x, dy, top_k=layer.top_k)
    assert res.margin > MIN_MARGIN, "near-tie in routing; pick another seed"
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, res.y, TOL[dtype], "y")
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        assert g is not None and g.dtype == dtype, name
        if ref_grads[name].abs().max() < 1e-10 * ref_grads["x"].abs().max():
            # analytically zero (top_k=1 with normalised weights: w = 1 whatever the router): rounding noise
            # only, measured against the scale of d x
            assert g.abs().max() <= TOL[dtype] * ref_grads["x"].abs().max(), name
            continue
        assert_close(g, ref_grads[name], TOL[dtype], f"grad {name}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_matches_oracle(routing, act, dtype):
    _against_oracle({**ROUTINGS[routing], **ACTIVATIONS[act]}, dtype, (T, H), seed=10)


def test_gemm_paths_are_the_ones_claimed():
    """The tests above run torch._grouped_mm in fp32 and the padded batched GEMM in float64 (so both are tested);
    sizes whose rows are not 16-byte multiples take the padded GEMM too."""
    cpu = torch.device("cpu")
    assert torch_backend.use_grouped_mm(cpu, torch.float32, (H, 24))
    assert torch_backend.use_grouped_mm(cpu, torch.bfloat16, (H, 24))
    assert torch_backend.use_grouped_mm(cpu, torch.float16, (H, 24))
    assert not torch_backend.use_grouped_mm(cpu, torch.float64, (H, 24))
    assert not torch_backend.use_grouped_mm(cpu, torch.float32, (12, 10))


EDGE_CASES = {  # (experts, top_k, hidden, inter, options)
    "k_equals_E": (4, 4, 16, 8, ROUTINGS["softmax_norm"]),
    "k1": (4, 1, 16, 8, ROUTINGS["sigmoid_norm_scaled"]),
    "idle_experts": (32, 2, 16, 8, ROUTINGS["softmax_norm"]),  # most of the 32 experts get no token
    "unaligned_sizes": (8, 3, 12, 10, {**ROUTINGS["sigmoid_group_bias"], "n_group": 8, "topk_group": 3}),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_edge_shapes_match_oracle(case, tokens, dtype):
    experts, k, hidden, inter, opts = EDGE_CASES[case]
    opts = {**opts, **ACTIVATIONS["shared_gate"]}
    _against_oracle(opts, dtype, (tokens, hidden), seed=110, experts=experts, top_k=k, hidden=hidden, inter=inter)


def test_experts_without_tokens_get_zero_gradients():
    """With 32 experts and 3 tokens most experts see no row: their weight and bias gradients are exact zeros
    (not stale memory), the others are not."""
    opts = {**ROUTINGS["softmax_norm"], **ACTIVATIONS["oai"]}
    layer = make_layer(opts, dtype=torch.float32, seed=5, experts=32, top_k=2, backend="torch")
    x, dy = random_x((3, H), torch.float32, 6), random_x((3, H), torch.float32, 7)
    _, grads = layer_forward_backward(layer, x, dy)
    used = set(layer.router_logits.topk(2).indices.reshape(-1).tolist())
    for name in ("experts.gate_up_proj", "experts.down_proj", "experts.gate_up_proj_bias", "experts.down_proj_bias"):
        g = grads[name]
        for e in range(32):
            assert (g[e].abs().sum() > 0) == (e in used), (name, e)


def test_no_tokens():
    layer = make_layer({**ROUTINGS["softmax_norm"], **ACTIVATIONS["shared_gate"]}, dtype=torch.float32, seed=3,
                       backend="torch")
    x = torch.zeros(0, H, requires_grad=True)
    y = layer(x)
    y.sum().backward()
    assert y.shape == (0, H) and x.grad.shape == (0, H)
    assert layer.experts.gate_up_proj.grad.abs().sum() == 0


def _relative_errors(a, b):
    return {k: ((a[k].double() - b[k].double()).norm() / b[k].double().norm()).item() for k in b}


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 4e-3), (torch.float32, 1e-6)],
                         ids=["bf16", "f16", "f32"])
def test_matches_reference_backend(dtype, tol):
    """Against the reference backend on the same layer and inputs. 16-bit: the GEMMs round their outputs to the
    storage dtype where the reference keeps some in fp32 (a few ulps of it: bf16 2^-8, fp16 2^-11, relative L2);
    fp32: the order of sums inside the GEMMs."""
    opts = {**ROUTINGS["sigmoid_group_bias"], **ACTIVATIONS["shared_gate"]}
    x, dy = random_x((41, H), dtype, 21), random_x((41, H), dtype, 22)
    y_t, g_t = layer_forward_backward(make_layer(opts, dtype=dtype, seed=20, backend="torch"), x, dy)
    y_r, g_r = layer_forward_backward(make_layer(opts, dtype=dtype, seed=20, backend="reference"), x, dy)
    errs = _relative_errors({"y": y_t, **g_t}, {"y": y_r, **g_r})
    assert all(e < tol for e in errs.values()), errs
    if dtype != torch.float32:
        assert max(errs.values()) > 0  # the comparison sees the rounding it allows for


def test_bf16_close_to_oracle():
    opts = {**ROUTINGS["softmax_norm"], **ACTIVATIONS["shared_gate"]}
    layer = make_layer(opts, dtype=torch.bfloat16, seed=30, backend="torch")
    x, dy = random_x((T, H), torch.bfloat16, 31), random_x((T, H), torch.bfloat16, 32)
    y, grads = layer_forward_backward(layer, x, dy)
    res, ref_grads = oracle_forward_backward(layer, opts, x, dy)
    assert res.margin > MIN_MARGIN
    assert_close(y, res.y, 3e-2, "y")
    for name, g in grads.items():
        assert g.dtype == torch.bfloat16, name
        assert_close(g, ref_grads[name], 5e-2, f"grad {name}")


# --- determinism


def _run_twice(dtype, deterministic_mode=False):
    opts = {**ROUTINGS["sigmoid_group_bias"], **ACTIVATIONS["oai"], "shared_intermediate_size": 20,
            "shared_expert_gate": True}
    layer = make_layer(opts, dtype=dtype, seed=50, backend="torch")
    x, dy = random_x((257, H), dtype, 51), random_x((257, H), dtype, 52)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic_mode)
    try:
        return [layer_forward_backward(layer, x, dy) for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(before)


def _assert_same(a, b):
    (y0, g0), (y1, g1) = a, b
    assert torch.equal(y0, y1)
    assert set(g0) == set(g1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_bitwise_deterministic(dtype):
    torch.set_num_threads(2)  # the default of a 2-core machine: the GEMMs run threaded
    try:
        first, second = _run_twice(dtype)
        _assert_same(first, second)
        # deterministic-algorithms mode raises on no op here, and changes no bit
        _assert_same(first, _run_twice(dtype, deterministic_mode=True)[0])
    finally:
        torch.set_num_threads(1)


# --- no host synchronisation


class _RecordOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bool_index = func is torch.ops.aten.index.Tensor and any(
            t is not None and t.dtype == torch.bool for t in args[1])
        self.ops.append("index with a boolean mask" if bool_index else str(func.overloadpacket))
        return func(*args, **kwargs)


# aten ops that read device values back to the host (.item(), tolist(), bool(t), bincount, nonzero, ...)
SYNC_OPS = {"aten._local_scalar_dense", "aten.nonzero", "aten.bincount", "aten.masked_select", "aten.unique",
            "aten._unique2", "aten.unique_consecutive", "aten.histc", "index with a boolean mask"}


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("opts", ["swiglu", "oai"])
def test_no_host_synchronisation(opts, precision):
    """Every aten op of the routed experts' forward and backward (MoKFunction on the torch backend) is recorded:
    none of them reads device values on the host. The reference backend does (bincount, tolist): the recorder
    sees it, so the check can fail."""
    from mok_nn import functional
    from mok_nn.autograd import MoKFunction
    from mok_nn.router import route

    layer = make_layer({**ROUTINGS["softmax_norm"], **ACTIVATIONS[opts]}, dtype=torch.bfloat16, seed=9,
                       hidden=64, inter=32, precision=precision)
    x = random_x((40, 64), torch.bfloat16, 10)
    ids, w, _ = route(layer.router(x).detach(), layer.top_k)
    e = layer.experts
    params = [p.detach().clone().requires_grad_(True) if p is not None else None
              for p in (e.gate_up_proj, e.down_proj, e.gate_up_proj_bias, e.down_proj_bias)]
    seen = {}
    for backend in ("torch", "reference"):
        ws = functional.get_workspace(hidden_size=64, intermediate_size=32, num_experts=layer.num_experts,
                                      top_k=layer.top_k, dtype=torch.bfloat16, backend=backend,
                                      activation=layer.activation, swiglu_limit=layer.swiglu_limit,
                                      precision=precision)
        xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        with _RecordOps() as rec:
            y = MoKFunction.apply(xx, ww, *params, ids, ws)
            y.float().square().sum().backward()
        seen[backend] = set(rec.ops)
    assert "aten._grouped_mm" in seen["torch"]
    assert not seen["torch"] & SYNC_OPS, seen["torch"] & SYNC_OPS
    assert seen["reference"] & SYNC_OPS


# --- precision="mxfp8"


@pytest.mark.parametrize("activation,limit", [("swiglu", None), ("swiglu_oai", 7.0)])
def test_mxfp8_matches_float64_model(activation, limit):
    """The MXFP8 expert computation (docs/mxfp8.md) against tests/test_mxfp8_layer.py's float64 model, on operands
    whose magnitudes spread over 2^-10..2^10 so that the quantisation blocks show: far from the unquantised
    math and from weight-gradient blocks formed in another row order."""
    from test_mxfp8_layer import NAMES, _inputs, _rel, model

    x, ids, w, p, dy = _inputs(0)
    y, saved = torch_backend.experts_forward(x, ids, w, *p, activation, limit, precision="mxfp8")
    dx, dw, g = torch_backend.experts_backward(dy, saved, x, ids, w, *p, activation, limit, precision="mxfp8")
    got = (y, dx, dw, g.gate_up_proj, g.down_proj, g.gate_up_bias, g.down_bias)
    want = model(x, ids, w, p, dy, activation, limit)
    plain = model(x, ids, w, p, dy, activation, limit, q=lambda a, axis: a)
    wrong_blocks = model(x, ids, w, p, dy, activation, limit, token_perm=lambda n: torch.arange(n).flip(0))
    for name, a, b, c, f in zip(NAMES, got, want, plain, wrong_blocks):
        err = _rel(a, b)
        assert err < 1e-6, (name, err)
        if name != "d_down_bias":
            assert _rel(c, b) > 1000 * max(err, 1e-8), name
        if name in ("d_gate_up_proj", "d_down_proj"):
            assert _rel(f, b) > 10 * max(err, 1e-8), name


def test_mxfp8_layer_matches_reference_backend():
    """bf16 layer, precision="mxfp8": the torch backend against the reference backend (same quantisation; the
    GEMM outputs rounded to bf16 first, as in bf16), and bitwise deterministic."""
    opts = {**ROUTINGS["softmax_norm"], **ACTIVATIONS["oai"]}
    x, dy = random_x((70, 64), torch.bfloat16, 1), random_x((70, 64), torch.bfloat16, 2)
    kw = dict(dtype=torch.bfloat16, seed=0, hidden=64, inter=32, experts=8, top_k=2, precision="mxfp8")
    t1 = layer_forward_backward(make_layer(opts, backend="torch", **kw), x, dy)
    t2 = layer_forward_backward(make_layer(opts, backend="torch", **kw), x, dy)
    r = layer_forward_backward(make_layer(opts, backend="reference", **kw), x, dy)
    _assert_same(t1, t2)
    errs = _relative_errors({"y": t1[0], **t1[1]}, {"y": r[0], **r[1]})
    assert all(e < 3e-2 for e in errs.values()), errs
    bf16 = layer_forward_backward(make_layer(opts, backend="torch", **{**kw, "precision": "bf16"}), x, dy)
    assert _relative_errors({"y": t1[0]}, {"y": bf16[0]})["y"] > 1e-3  # the quantisation is applied


def test_fast_fake_quantize_equals_fake_quantize():
    """mxfp8.fake_quantize_fast gives mxfp8.fake_quantize's values bit for bit, edge cases included."""
    from mok_nn.mxfp8 import fake_quantize, fake_quantize_fast

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.exp2(torch.rand(64, 256, generator=g) * 80 - 40)
    x[0, :32] = 0
    x[1, :32] = 1.75
    x[2, 3] = float("nan")
    x[3, 5] = float("inf")
    x[4, :32] = -0.0
    x[5, :32] = 1e-40  # subnormal block
    x[6, :32] = 3e38
    x[7, 7] = 1.75 * 2.0**100
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype) if dtype != torch.float16 else (x * 2.0**-30).clamp(-6e4, 6e4).to(dtype)
        for axis in (-1, 0):
            a, b = fake_quantize(xd, axis), fake_quantize_fast(xd, axis)
            assert a.dtype == b.dtype == dtype
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), (dtype, axis)
            num = ~a.isnan()  # (a NaN's sign bit means nothing: the two routes may differ there)
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.signbit()[num], b.signbit()[num])


# --- backend="auto"


def test_auto_picks_the_portable_backend_on_cpu(caplog, monkeypatch):
    """On CPU "auto" runs the torch backend (same bits as backend="torch") and says so once, with the reason."""
    from mok_nn import layer as layer_module

    monkeypatch.setattr(layer_module, "_LOGGED_FALLBACKS", set())
    opts = {**ROUTINGS["softmax_norm"], **ACTIVATIONS["swiglu"]}
    x, dy = random_x((T, H), torch.float32, 1), random_x((T, H), torch.float32, 2)
    with caplog.at_level("INFO", logger="mok_nn"):
        y_auto, g_auto = layer_forward_backward(make_layer(opts, dtype=torch.float32, seed=0, backend="auto"), x, dy)
        layer_forward_backward(make_layer(opts, dtype=torch.float32, seed=0, backend="auto"), x, dy)
    y_torch, g_torch = layer_forward_backward(make_layer(opts, dtype=torch.float32, seed=0, backend="torch"), x, dy)
    _assert_same((y_auto, g_auto), (y_torch, g_torch))
    msgs = [r.getMessage() for r in caplog.records if r.name == "mok_nn"]
    assert len(msgs) == 1 and "portable backend" in msgs[0] and "cpu" in msgs[0], msgs


def test_layer_with_router_losses_reads_nothing_back():
    """The whole layer on the torch backend with both router losses on (load balancing, z-loss), forward and
    backward, every aten op recorded: none reads device values on the host (the load-balancing counts are an
    integer scatter_add_, not bincount), and the loss is the Switch formula with bincount's counts."""
    from mok_nn import MoKMoELayer

    torch.manual_seed(11)
    layer = MoKMoELayer(64, 32, 8, 2, backend="torch", dtype=torch.float32, aux_loss_coef=0.01, z_loss_coef=0.001)
    x = torch.randn(40, 64, requires_grad=True)
    with _RecordOps() as rec:
        y = layer(x)
        (y.square().sum() + layer.aux_loss).backward()
    assert not set(rec.ops) & SYNC_OPS, set(rec.ops) & SYNC_OPS
    logits = layer.router_logits.detach().double()
    scores = logits.softmax(-1)
    ids = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :2]
    f = torch.bincount(ids.reshape(-1), minlength=8).double() / ids.numel()
    want = 0.01 * 8 * (f * scores.mean(0)).sum() + 0.001 * torch.logsumexp(logits, -1).square().mean()
    assert abs(layer.aux_loss.item() - want.item()) <= 1e-6 * abs(want.item())


# --- peak memory


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_consumed_saved_tensors_keep_the_bits(act, dtype):
    """experts_backward(consume_saved=True) (autograd keeps no graph) writes d gate_up over the saved gate_up and
    gives the bits of the backward that keeps it, for every activation option and with biases."""
    g = torch.Generator().manual_seed(60)
    t, h, inter, e, k = 29, 64, 32, 8, 3
    opts = ACTIVATIONS[act]
    x = torch.randn(t, h, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g).to(dtype)
    w13, w2 = (torch.randn(e, 2 * inter, h, generator=g) / 8).to(dtype), (torch.randn(e, h, inter, generator=g) / 6).to(dtype)
    b13, b2 = torch.randn(e, 2 * inter, generator=g).to(dtype), torch.randn(e, h, generator=g).to(dtype)
    dy = torch.randn(t, h, generator=g).to(dtype)
    args = (x, ids, w, w13, w2, b13, b2, opts.get("activation", "swiglu"), opts.get("swiglu_limit"))

    def backward(consume):
        _, saved = torch_backend.experts_forward(*args)
        before = saved.gate_up.clone()
        dx, d_topk, grads = torch_backend.experts_backward(dy, saved, *args, consume_saved=consume)
        return dx, d_topk, grads, not torch.equal(saved.gate_up, before)

    dx0, dt0, g0, changed0 = backward(False)
    dx1, dt1, g1, changed1 = backward(True)
    assert not changed0 and changed1  # the kept backward leaves gate_up alone; the consuming one reuses it
    assert torch.equal(dx0, dx1) and torch.equal(dt0, dt1)
    for name in ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias"):
        assert torch.equal(getattr(g0, name), getattr(g1, name)), name
    assert g0.grad_rows is None and g1.grad_rows is None  # summed into dx, not kept
    if dtype == torch.float32:  # and the function itself: the reference backend's (in bf16 a clamp may flip)
        ref_dx, _, ref_g = reference.experts_backward(dy, reference.experts_forward(*args)[1], *args)
        for got, want in ((dx1, ref_dx), (g1.gate_up_proj, ref_g.gate_up_proj), (g1.down_proj, ref_g.down_proj)):
            assert_close(got, want, 1e-5, "against the reference backend")


def test_gathered_slots_sum_as_the_whole_copy():
    """combine_slots / sum_slots over GatheredSlots (the rows read a chunk of tokens at a time) give the bits of the
    same sums over the whole [T, k, H] copy of the rows, across several chunks."""
    from mok_nn import mxfp8

    g = torch.Generator().manual_seed(61)
    t, k, h = 300, 3, 64
    rows = torch.randn(t * k, h, generator=g).bfloat16()
    inverse = torch.randperm(t * k, generator=g)
    w = torch.rand(t, k, generator=g)
    whole = rows.index_select(0, inverse).view(t, k, h)
    gathered = torch_backend.GatheredSlots(rows, inverse, t, k)
    chunks = mxfp8.row_chunks(t, k * h * 4, rows.device)
    old = mxfp8.chunk_bytes
    try:
        mxfp8.chunk_bytes = lambda device: 64 * k * h * 4  # chunks of 64 tokens
        assert len(mxfp8.row_chunks(t, k * h * 4, rows.device)) == 5
        assert torch.equal(torch_backend.combine_slots(gathered, w, torch.bfloat16),
                           torch_backend.combine_slots(whole, w, torch.bfloat16))
        assert torch.equal(torch_backend.sum_slots(gathered, torch.float32), torch_backend.sum_slots(whole, torch.float32))
    finally:
        mxfp8.chunk_bytes = old
    assert chunks  # (the default chunking, restored)


def test_retained_graph_backward_twice_gives_the_same_gradients():
    """With retain_graph=True the portable backward leaves the saved gate_up alone (it overwrites it only where
    autograd keeps no graph), so a second backward through the same graph gives the first one's gradients."""
    layer = make_layer({**ACTIVATIONS["oai"]}, dtype=torch.float32, seed=62, backend="torch")
    x = random_x((T, H), torch.float32, 63).requires_grad_(True)
    dy = random_x((T, H), torch.float32, 64)
    y = layer(x)
    (y * dy).sum().backward(retain_graph=True)
    first = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    x.grad = None
    (y * dy).sum().backward()
    second = [x.grad] + [p.grad for p in layer.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(first, second))
