"""Frozen expert tensors (requires_grad_(False)): no gradient for them, their weight-gradient GEMMs (and bias
sums) not run on any backend, and d x / d topk-weights / the router gradient bitwise those of the unfrozen run."""

import pytest
import torch

from mok_nn import MoKConfig, MoKMoELayer
from mok_nn import cuda_backend as cb
from mok_nn import cuda_ep, reference, torch_backend
from mok_nn.functional import ExpertParams

from helpers import single_thread  # noqa: F401
from test_cuda_ep_simulated import _problem, _rank_workspace, _run_ranks, _shared_buffers, cpu_kernels  # noqa: F401
from test_cuda_wiring import fake_lib, random_problem  # noqa: F401

T, H, I, E, K = 41, 64, 32, 8, 2
EXPERT_TENSORS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
FROZEN_SETS = {
    "weights": ("gate_up_proj", "down_proj"),
    "all": EXPERT_TENSORS,
    "gate_up": ("gate_up_proj",),
    "down_and_bias": ("down_proj", "down_proj_bias"),
}


def _run(backend, precision, frozen, config=None):
    """y, d x, d router weight and the expert tensors' gradients of one step of a layer with `frozen` expert
    tensors frozen."""
    torch.manual_seed(0)
    layer = MoKMoELayer(H, I, E, K, backend=backend, precision=precision, expert_proj_bias=True, config=config)
    with torch.no_grad():
        layer.experts.gate_up_proj_bias.normal_(0, 0.1)
        layer.experts.down_proj_bias.normal_(0, 0.1)
    for name in frozen:
        getattr(layer.experts, name).requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).bfloat16().requires_grad_(True)
    y = layer(x)
    y.float().mul(torch.randn(y.shape, generator=g)).sum().backward()
    return y, x.grad, layer.router.weight.grad, {n: getattr(layer.experts, n).grad for n in EXPERT_TENSORS}


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("frozen", list(FROZEN_SETS))
def test_frozen_tensors_get_no_gradient_and_dx_keeps_its_bits(backend, precision, frozen):
    y0, dx0, dr0, g0 = _run(backend, precision, ())
    y1, dx1, dr1, g1 = _run(backend, precision, FROZEN_SETS[frozen])
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1) and torch.equal(dr0, dr1)
    for name in EXPERT_TENSORS:
        if name in FROZEN_SETS[frozen]:
            assert g1[name] is None, name
        else:
            assert g1[name] is not None and torch.equal(g1[name], g0[name]), name


def test_frozen_with_macrobatch_passes():
    cfg = MoKConfig(macrobatch_size=16)
    y0, dx0, dr0, g0 = _run("reference", "bf16", (), cfg)
    y1, dx1, dr1, g1 = _run("reference", "bf16", ("gate_up_proj", "down_proj"), cfg)
    assert torch.equal(dx0, dx1) and torch.equal(dr0, dr1)
    assert g1["gate_up_proj"] is None and g1["down_proj"] is None
    assert torch.equal(g1["down_proj_bias"], g0["down_proj_bias"])


@pytest.mark.parametrize("frozen,calls", [((), 4), (("gate_up_proj", "down_proj"), 2), (EXPERT_TENSORS, 0),
                                          (("down_proj",), 3)])
def test_torch_backend_skips_the_weight_gradient_gemms(monkeypatch, frozen, calls):
    """Groups.wgrad runs the weight-gradient GEMMs and the bias sums (segment_sum): one call per gradient."""
    seen = []
    real = torch_backend.Groups.wgrad

    def spy(self, a, b):
        seen.append((tuple(a.shape), tuple(b.shape)))
        return real(self, a, b)

    monkeypatch.setattr(torch_backend.Groups, "wgrad", spy)
    _run("torch", "bf16", frozen)
    assert len(seen) == calls, seen


def _count_weight_grads(monkeypatch):
    calls = []
    real = cb.weight_grad

    def spy(a_rows, b_rows, sched, counts, **kw):
        calls.append(tuple(b_rows.shape))
        return real(a_rows, b_rows, sched, counts, **kw)

    monkeypatch.setattr(cb, "weight_grad", spy)
    return calls


@pytest.mark.parametrize("needs,launched", [(None, 2), ((False, False, True, True), 0), ((True, False, True, True), 1),
                                            ((False, True, False, False), 1)])
def test_cuda_backend_skips_the_weight_gradient_kernels(fake_lib, monkeypatch, needs, launched):
    """The one-GPU path (CPU stand-in library): frozen weights launch no weight-gradient kernel; frozen biases
    get no sum; d x and d topk-weights are the bits of the full backward."""
    calls = _count_weight_grads(monkeypatch)
    x, ids, w, dy, W13, W2, b13, b2 = random_problem(37, 32, 16, 4, 2, True, seed=5)
    args = (W13, W2, b13, b2, "swiglu", None)
    y, saved = cb.experts_forward(x, ids, w, *args)
    dx0, dtk0, g0 = cb.experts_backward(dy, saved, x, ids, w, *args)
    assert len(calls) == 2
    del calls[:]
    dx, dtk, g = cb.experts_backward(dy, saved, x, ids, w, *args, needs=needs)
    assert len(calls) == launched
    assert torch.equal(dx, dx0) and torch.equal(dtk, dtk0)
    wanted = reference.param_grads_needed(needs)
    for name, want in zip(("gate_up_proj", "down_proj", "gate_up_bias", "down_bias"), wanted):
        got, full = getattr(g, name), getattr(g0, name)
        assert (got is None) == (not want), name
        if want:
            assert torch.equal(got, full), name
    # a second macrobatch pass adding into the first one's gradients: frozen ones stay None, nothing launched
    del calls[:]
    _, _, g2 = cb.experts_backward(dy, saved, x, ids, w, *args, grads_into=g, needs=needs)
    assert len(calls) == launched
    assert (g2.gate_up_proj is None) == (not wanted[0]) and (g2.down_proj is None) == (not wanted[1])


def test_cuda_ep_backward_skips_the_weight_gradient_kernels(cpu_kernels, monkeypatch):
    """cuda_ep.backward (EP = 2 simulated on CPU threads): no weight-gradient kernel for frozen weights, no bias
    sums for frozen biases, the same d x and d topk-weights bits as the full backward."""
    calls = _count_weight_grads(monkeypatch)
    H2, I2, E2, K2, tokens = 32, 16, 8, 2, [23, 9]
    W13, W2, b13, b2, xs, dys, ids, ws_ = _problem(torch.Generator().manual_seed(3), tokens, H2, I2, E2, K2, True, 0.1)

    def run(needs):
        raws, barrier = _shared_buffers(2, max(tokens), H2, K2)

        def rank_fn(r):
            sl = slice(r * E2 // 2, (r + 1) * E2 // 2)
            params = ExpertParams(W13[sl], W2[sl], b13[sl], b2[sl])
            ws = _rank_workspace(raws, r, max(tokens), E2, H2, K2, barrier)
            _, saved = cuda_ep.forward(xs[r], ids[r], ws_[r], params, None, ws)
            return cuda_ep.backward(dys[r], saved, xs[r], ids[r], ws_[r], params, ws, needs=needs)

        return _run_ranks(rank_fn, 2)

    full = run(None)
    assert len(calls) == 4
    del calls[:]
    frozen = run((False, False, True, False))
    assert len(calls) == 0
    for (dx0, dw0, g0), (dx1, dw1, g1) in zip(full, frozen):
        assert torch.equal(dx0, dx1) and torch.equal(dw0, dw1)
        assert g1.gate_up_proj is None and g1.down_proj is None and g1.down_bias is None
        assert torch.equal(g1.gate_up_bias, g0.gate_up_bias)


def test_cuda_forward_told_of_frozen_gate_up_keeps_the_same(fake_lib):
    """The one-GPU forward told that d W13 is not wanted keeps the same tensors (it keeps no x rows either way);
    y, d x and d topk-weights are the bits of the full run; a later need for d W13 gathers x's rows again."""
    x, ids, w, dy, W13, W2, b13, b2 = random_problem(37, 32, 16, 4, 2, True, seed=6)
    args = (W13, W2, b13, b2, "swiglu", None)
    y0, saved0 = cb.experts_forward(x, ids, w, *args)
    dx0, dtk0, g0 = cb.experts_backward(dy, saved0, x, ids, w, *args)
    needs = (False, True, True, True)
    y, saved = cb.experts_forward(x, ids, w, *args, needs=needs)
    used = int(saved.sched.seg_end[-1])  # (rows past the last segment stay unwritten)
    assert torch.equal(saved.gate_up[:used], saved0.gate_up[:used])
    dx, dtk, g = cb.experts_backward(dy, saved, x, ids, w, *args, needs=needs)
    assert torch.equal(y, y0) and torch.equal(dx, dx0) and torch.equal(dtk, dtk0)
    assert g.gate_up_proj is None and torch.equal(g.down_proj, g0.down_proj)
    _, _, g_all = cb.experts_backward(dy, saved, x, ids, w, *args)  # d W13 after all
    assert torch.equal(g_all.gate_up_proj, g0.gate_up_proj)
