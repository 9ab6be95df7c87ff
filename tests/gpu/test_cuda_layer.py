"""MoKMoELayer(backend="cuda") against backend="reference" on the same GPU: within bf16
rounding, bitwise reproducible, and backend="auto" choosing the kernels on sm_90; the layer's schedule and
row gathers against torch ops; macrobatch passes on the accumulating weight-gradient kernel."""

import pytest
import torch

from mok_nn import MoKMoELayer
from mok_nn.autograd import MoKFunction

from layer_runs import GRAD_NAMES, rel_err as _rel, run_layer as _run

cuda_ok = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not cuda_ok, reason="needs an sm_90 CUDA GPU")


@pytest.mark.parametrize("opts", [
    dict(),
    dict(score_func="sigmoid", n_group=4, topk_group=2, use_expert_bias=True, routed_scaling_factor=2.5,
         shared_intermediate_size=64, shared_expert_gate=True),
    dict(activation="swiglu_oai", swiglu_limit=7.0, expert_proj_bias=True),
])
@pytest.mark.parametrize("T", [1, 777])
def test_cuda_layer_matches_reference_and_repeats(opts, T):
    torch.manual_seed(0)
    H, I, E, K = 256, 128, 16, 4
    ref = MoKMoELayer(H, I, E, K, device="cuda", backend="reference", **opts)
    fused = MoKMoELayer(H, I, E, K, device="cuda", backend="cuda", **opts)
    fused.load_state_dict(ref.state_dict())
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    dy = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    got = _run(fused, x, dy)
    again = _run(fused, x, dy)
    for a, b in zip(got, again):
        assert torch.equal(a, b), "CUDA path must be bitwise reproducible"
    want = _run(ref, x, dy)
    for name, a, b in zip(GRAD_NAMES, got, want):
        assert not torch.isnan(a).any(), name
        assert _rel(a, b) < 2e-2, (name, _rel(a, b))


def test_auto_picks_cuda():
    layer = MoKMoELayer(256, 128, 8, 2, device="cuda", backend="auto")
    x = torch.randn(16, 256, device="cuda").to(torch.bfloat16)
    assert layer._choose_backend(x) == "cuda"


def _routed_problem(T, seed, H=512, I=256, E=16, K=4):
    """(x, d y, top-k ids, top-k weights, [W13, W2]): random bf16 inputs of the routed experts on the GPU,
    K distinct experts per token."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = torch.bfloat16
    x = torch.randn(T, H, device="cuda", generator=g).to(bf)
    dy = torch.randn(T, H, device="cuda", generator=g).to(bf)
    ids = torch.rand(T, E, device="cuda", generator=g).argsort(dim=1)[:, :K].contiguous()
    w = torch.rand(T, K, device="cuda", generator=g).to(bf)
    params = [(torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5).to(bf),
              (torch.randn(E, H, I, device="cuda", generator=g) / I**0.5).to(bf)]
    return x, dy, ids, w, params


def _routed_cuda(x, ids, w, params, dy, config):
    """MoKFunction on the CUDA path under `config`: y, d x, d topk-weights, d expert parameters."""
    from mok_nn import functional
    from mok_nn.autograd import MoKFunction

    H, I = x.shape[1], params[1].shape[2]
    ws = functional.get_workspace(hidden_size=H, intermediate_size=I, num_experts=params[0].shape[0],
                                  top_k=ids.shape[1], device="cuda", backend="cuda", config=config)
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    ps = [p.clone().requires_grad_(True) for p in params]
    y = MoKFunction.apply(x, w, *ps, None, None, ids, ws)
    y.backward(dy)
    return [y.detach(), x.grad, w.grad] + [p.grad for p in ps]


@pytest.mark.parametrize("T,size", [(1000, 384), (777, 777 // 2 + 1)])
def test_macrobatch_passes_keep_the_bits(T, size, launched_kernels):
    """MoKConfig.macrobatch_size on the kernels: y, d x and d topk-weights are the one-pass bits (every
    row is computed alike); the expert gradients are the per-pass gradients (separate one-pass calls)
    summed in pass order in bf16 (the accumulating weight-gradient kernel, mok_gemm_wgrad_defer_c2_acc, per pass
    after the first once for d down_proj and once per column block of d gate_up_proj), and close to one pass."""
    from mok_nn import MoKConfig
    from mok_nn import cuda_backend as cb

    x, dy, ids, w, params = _routed_problem(T, seed=T)
    launched_kernels.clear()
    one = _routed_cuda(x, ids, w, params, dy, MoKConfig())
    assert "mok_gemm_wgrad_defer_c2_acc" not in launched_kernels
    cfg = MoKConfig(macrobatch_size=size)
    launched_kernels.clear()
    got = _routed_cuda(x, ids, w, params, dy, cfg)
    passes = -(-T // size)
    per_pass = 1 + len(cb.x_column_blocks(x.shape[1], cb.schedule_capacity(size, ids.shape[1], 16)))  # (E = 16)
    assert launched_kernels.count("mok_gemm_wgrad_defer_c2_acc") == per_pass * (passes - 1), launched_kernels
    again = _routed_cuda(x, ids, w, params, dy, cfg)
    for i, (a, b) in enumerate(zip(got, again)):
        assert torch.equal(a, b), f"output {i}: not bitwise reproducible"
    for i, name in enumerate(("y", "d x", "d topk-weights")):
        assert torch.equal(got[i], one[i]), f"{name}: not the one-pass bits"
    parts = [_routed_cuda(x[s:s + size], ids[s:s + size], w[s:s + size], params, dy[s:s + size], MoKConfig())
             for s in range(0, T, size)]
    assert len(parts) >= 2
    for i in (3, 4):
        want = parts[0][i]
        for p in parts[1:]:
            want = want + p[i]  # bf16 + bf16, one rounding: what the kernel's adding stores give
        assert torch.equal(got[i], want), f"expert gradient {i - 3}: not the per-pass sum"
        assert _rel(got[i], one[i]) < 1e-2, (i, _rel(got[i], one[i]))


def test_schedule_and_gathers_keep_the_bits(monkeypatch, launched_kernels):
    """The layer's schedule and row gathers (mok_schedule_gather: the schedule and the x rows in one host call;
    mok_scatter_rows: the d y rows) against torch ops: with make_schedule_torch and index_select in their
    place, every output and gradient of the routed experts has the same bits (the rows are exact copies, the
    schedule the same). mok_scatter_rows runs for the d y rows and for each column block of x's rows (the
    gate/up weight's gradient)."""
    from mok_nn import MoKConfig
    from mok_nn import cuda_backend as cb

    x, dy, ids, w, params = _routed_problem(900, seed=5)
    launched_kernels.clear()
    got = _routed_cuda(x, ids, w, params, dy, MoKConfig())
    assert launched_kernels[0] == "mok_schedule_gather", launched_kernels
    scatters = 1 + len(cb.x_column_blocks(x.shape[1], cb.schedule_capacity(*ids.shape, 16)))  # (E = 16)
    assert launched_kernels.count("mok_scatter_rows") == scatters and "mok_schedule_mc" not in launched_kernels
    monkeypatch.setattr(cb, "make_schedule", lambda ids, num_experts, capacity=None, gather_x=None, gather_mx=False:
                        cb.make_schedule_torch(ids, num_experts, capacity))
    monkeypatch.setattr(cb, "_gather_rows_kernel", lambda src, slots, mx=False: None)  # take_rows: index_select
    launched_kernels.clear()
    want = _routed_cuda(x, ids, w, params, dy, MoKConfig())
    assert not {"mok_schedule_gather", "mok_schedule_mc", "mok_scatter_rows", "mok_gather_rows"} & set(launched_kernels)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"output {i} differs"


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_layer_launches_the_schedule_right_after_the_router(precision, monkeypatch, launched_kernels):
    """The layer builds the fused path's schedule (and gathers x with it) right after the router, once per
    forward, so the GPU builds it while the host prepares the rest of the call: its first kernel launch is
    mok_schedule_gather and no second schedule or x gather follows; every output and gradient has the bits of
    the layer whose MoKFunction builds the schedule itself, run after run."""
    from mok_nn import cuda_backend as cb

    torch.manual_seed(4)
    H, I, E, K, T = 256, 128, 16, 4, 555
    layer = MoKMoELayer(H, I, E, K, device="cuda", backend="cuda", precision=precision)
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    dy = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    events = []  # host order: the schedule's launch against MoKFunction's start
    make, function_forward = cb.make_schedule, MoKFunction.forward
    monkeypatch.setattr(cb, "make_schedule", lambda *a, **kw: events.append(("schedule", kw.get("gather_x")))
                        or make(*a, **kw))
    monkeypatch.setattr(MoKFunction, "forward", staticmethod(lambda *a: events.append(("function", None))
                                                             or function_forward(*a)))
    launched_kernels.clear()
    got = _run(layer, x, dy)
    assert [e for e, _ in events] == ["schedule", "function"] and events[0][1] is not None, events
    assert launched_kernels[0] == "mok_schedule_gather" and "mok_schedule_mc" not in launched_kernels
    forward = launched_kernels[:launched_kernels.index("mok_combine_cp") + 1]
    assert forward.count("mok_schedule_gather") == 1 and "mok_scatter_rows" not in forward, forward
    again = _run(layer, x, dy)
    monkeypatch.setattr(MoKMoELayer, "_early_schedule", staticmethod(lambda *args: None))
    events.clear()
    inside = _run(layer, x, dy)
    assert [e for e, _ in events] == ["function", "schedule"], events  # MoKFunction built it
    for name, a, b, c in zip(GRAD_NAMES, got, again, inside):
        assert torch.equal(a, b) and torch.equal(a, c), name


def test_retained_graph_backward_keeps_the_bits():
    """backward(retain_graph=True) keeps gate_up (a second backward reads it again); a plain backward writes d
    gate_up over it. Both backwards of a retained graph, and a plain one, give the same bits."""
    torch.manual_seed(3)
    layer = MoKMoELayer(512, 256, 16, 4, device="cuda", backend="cuda")
    x = torch.randn(700, 512, device="cuda").to(torch.bfloat16)
    dy = torch.randn(700, 512, device="cuda").to(torch.bfloat16)
    plain = _run(layer, x, dy)
    layer.zero_grad(set_to_none=True)
    xr = x.detach().clone().requires_grad_()
    y = layer(xr)
    runs = []
    for retain in (True, False):
        layer.zero_grad(set_to_none=True)
        xr.grad = None
        y.backward(dy, retain_graph=retain)
        e = layer.experts
        runs.append([xr.grad, e.gate_up_proj.grad, e.down_proj.grad, layer.router.weight.grad])
    for name, a, b, c in zip(("dx", "d gate_up_proj", "d down_proj", "d router"), runs[0], runs[1], plain[1:]):
        assert torch.equal(a, b), f"{name}: the second backward of a retained graph differs"
        assert torch.equal(a, c), f"{name}: differs from a plain backward"


@pytest.mark.parametrize("opts", [
    dict(aux_loss_coef=0.01, z_loss_coef=0.001),
    dict(score_func="sigmoid", n_group=4, topk_group=2, use_expert_bias=True, routed_scaling_factor=2.5,
         shared_intermediate_size=64, shared_expert_gate=True, aux_loss_coef=0.01),
])
def test_layer_reads_nothing_back(opts):
    """The whole layer (router, top-k, router losses, fused experts, shared expert), forward and backward, under
    torch.cuda.set_sync_debug_mode("error"): no host synchronisation anywhere (after a warm-up call)."""
    torch.manual_seed(4)
    layer = MoKMoELayer(256, 128, 16, 4, device="cuda", backend="cuda", dtype=torch.bfloat16, **opts)
    x = torch.randn(777, 256, device="cuda").to(torch.bfloat16).requires_grad_()
    dy = torch.randn(777, 256, device="cuda").to(torch.bfloat16)

    def step():
        y = layer(x)
        torch.autograd.backward([y, layer.aux_loss], [dy, torch.ones((), device="cuda")])

    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(x.grad).all()
