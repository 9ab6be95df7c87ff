"""The functional layer (get_workspace -> build_schedule -> forward -> backward)
gives the layer's results bit for bit, and its d x / d topk_weights match
float64 autograd through the oracle's expert MLP."""

import pytest
import torch

import oracle
from helpers import (ACTIVATIONS, E, H, I, K, ROUTINGS, assert_close, layer_forward_backward, make_layer, random_x,
                     single_thread)  # noqa: F401

T = 13
# No shared expert: the layer's output is then the routed experts alone.
OPTS = {**ROUTINGS["sigmoid_group_bias"], **ACTIVATIONS["oai_limit"]}
# As in test_layer.py (measured there).
TOL = {torch.float64: 1e-12, torch.float32: 5e-6}


def _workspace(dtype, **kw):
    from mok_nn import functional

    return functional.get_workspace(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, device="cpu",
                                    dtype=dtype, backend="reference", activation=OPTS["activation"],
                                    swiglu_limit=OPTS["swiglu_limit"], **kw)


def _routing(layer):
    """The layer's own routing of its last forward (same function, same logits)."""
    from mok_nn.router import route

    ids, w = route(layer.router_logits.detach(), K, OPTS["score_func"], OPTS["norm_topk_prob"], OPTS["n_group"],
                   OPTS["topk_group"], OPTS["routed_scaling_factor"], layer.router.e_score_correction_bias)[:2]
    return ids, w.detach()


def _oracle_experts(layer, x, ids, w, dy):
    """y = sum_j w_tj * expert(x_t) in float64 with autograd: (y, d x, d w)."""
    p = {k: v.detach().to(torch.float64) for k, v in layer.state_dict().items()}
    x64 = x.detach().to(torch.float64).requires_grad_(True)
    w64 = w.detach().to(torch.float64).requires_grad_(True)
    rows = []
    for t in range(x.shape[0]):
        y_t = torch.zeros(H, dtype=torch.float64)
        for j, e in enumerate(ids[t].tolist()):
            y_t = y_t + w64[t, j] * oracle.expert_mlp(p, e, x64[t], OPTS["activation"], OPTS["swiglu_limit"])
        rows.append(y_t)
    y = torch.stack(rows)
    dx, dw = torch.autograd.grad((y * dy.to(torch.float64)).sum(), (x64, w64))
    return y.detach(), dx, dw


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["f64", "f32", "bf16"])
def test_functional_equals_layer(dtype):
    from mok_nn import functional

    layer = make_layer(OPTS, dtype=dtype, seed=80)
    x = random_x((T, H), dtype, 81)
    dy = random_x((T, H), dtype, 82)
    y_layer, grads_layer = layer_forward_backward(layer, x, dy)
    ids, w = _routing(layer)

    ws = _workspace(dtype)
    assert _workspace(dtype) is ws  # created once, reused
    schedule = functional.build_schedule(ids, ws)
    e = layer.experts
    params = functional.ExpertParams(e.gate_up_proj.detach(), e.down_proj.detach(), e.gate_up_proj_bias.detach(),
                                     e.down_proj_bias.detach())
    y, saved = functional.forward(x, ids, w, params, schedule, ws)
    assert y.dtype == dtype
    assert torch.equal(y, y_layer)
    dx, dw, grads = functional.backward(dy, saved, x, ids, w, params, ws)
    # Expert gradients do not depend on the router path: bitwise the layer's.
    assert torch.equal(grads.gate_up_proj, grads_layer["experts.gate_up_proj"])
    assert torch.equal(grads.down_proj, grads_layer["experts.down_proj"])
    assert torch.equal(grads.gate_up_bias, grads_layer["experts.gate_up_proj_bias"])
    assert torch.equal(grads.down_bias, grads_layer["experts.down_proj_bias"])
    assert dx.shape == x.shape and dw.shape == w.shape

    # d x (experts only; the layer's d x adds the router path) and d w against the oracle.
    if dtype in TOL:
        y64, dx64, dw64 = _oracle_experts(layer, x, ids, w, dy)
        assert_close(y, y64, TOL[dtype], "y")
        assert_close(dx, dx64, TOL[dtype], "d x")
        assert_close(dw, dw64, TOL[dtype], "d topk_weights")


def test_functional_empty():
    from mok_nn import functional

    dtype = torch.float32
    layer = make_layer(OPTS, dtype=dtype, seed=83)
    ws = _workspace(dtype)
    x = torch.zeros(0, H, dtype=dtype)
    ids = torch.zeros(0, K, dtype=torch.int64)
    w = torch.zeros(0, K, dtype=torch.float32)
    e = layer.experts
    params = functional.ExpertParams(e.gate_up_proj.detach(), e.down_proj.detach(), e.gate_up_proj_bias.detach(),
                                     e.down_proj_bias.detach())
    y, saved = functional.forward(x, ids, w, params, functional.build_schedule(ids, ws), ws)
    assert y.shape == (0, H)
    dx, dw, grads = functional.backward(torch.zeros(0, H, dtype=dtype), saved, x, ids, w, params, ws)
    assert dx.shape == (0, H) and dw.shape == (0, K)
    assert (grads.gate_up_proj == 0).all() and (grads.down_proj == 0).all()


def test_functional_bad_backend():
    from mok_nn import functional

    with pytest.raises(ValueError, match="backend"):
        functional.get_workspace(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, backend="tpu")


def test_layer_runs_experts_through_mokfunction():
    """The routed experts are one MoKFunction node with its explicit backward,
    not an autograd graph of the reference's operations."""
    layer = make_layer(OPTS, dtype=torch.float32, seed=84)
    y = layer(random_x((T, H), torch.float32, 85).requires_grad_(True))
    names, stack, seen = [], [y.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    assert names.count("MoKFunctionBackward") == 1, names


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_mokfunction_takes_a_schedule_made_by_its_caller(backend, monkeypatch):
    """MoKFunction's last argument: a schedule the caller built (the layer does so right after the router on the
    fused path) gives the bits of the one MoKFunction builds itself, forward and backward; with macrobatch passes
    it is refused (each pass makes its own)."""
    from mok_nn import MoKConfig, functional
    from mok_nn.autograd import MoKFunction

    layer = make_layer(OPTS, dtype=torch.float32, seed=86)
    layer(random_x((T, H), torch.float32, 87))
    ids, w = _routing(layer)
    x = random_x((T, H), torch.float32, 88)
    dy = random_x((T, H), torch.float32, 89)
    e = layer.experts

    def workspace(**kw):
        return functional.get_workspace(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, device="cpu",
                                        dtype=torch.float32, backend=backend, activation=OPTS["activation"],
                                        swiglu_limit=OPTS["swiglu_limit"], **kw)

    ws = workspace()

    def run(*schedule):
        xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = MoKFunction.apply(xx, ww, e.gate_up_proj, e.down_proj, e.gate_up_proj_bias, e.down_proj_bias, ids, ws,
                              None, None, *schedule)
        return (y, *torch.autograd.grad(y, (xx, ww, e.gate_up_proj, e.down_proj), dy))

    schedule = functional.build_schedule(ids, ws, x)
    built, build = [], functional.build_schedule
    monkeypatch.setattr(functional, "build_schedule", lambda *a: built.append(1) or build(*a))
    inside = run()
    assert built == [1]
    given = run(schedule)
    assert built == [1]  # MoKFunction took the caller's
    for a, b in zip(inside, given):
        assert torch.equal(a, b)
    passes = workspace(config=MoKConfig(macrobatch_size=5))
    with pytest.raises(ValueError, match="one pass"):
        MoKFunction.apply(x, w, e.gate_up_proj, e.down_proj, None, None, ids, passes, None, None,
                          functional.build_schedule(ids, passes, x))


def test_expert_activations_saved_through_autograd_hooks():
    """The expert rows and gate_up kept for backward are saved with ctx.save_for_backward,
    so saved-tensor hooks (activation checkpointing, torch.autograd.graph.save_on_cpu) see
    them; held as plain ctx attributes they would stay in memory under checkpointing."""
    from torch.utils.checkpoint import checkpoint

    layer = make_layer(OPTS, dtype=torch.float32, seed=86)
    x = random_x((T, H), torch.float32, 87)
    dy = random_x((T, H), torch.float32, 88)
    packed = []

    def pack(t):
        packed.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x.clone().requires_grad_(True))
    assert (T * K, 2 * I) in packed and (T * K, H) in packed, packed

    # Checkpointed: the same bits as without.
    y0, g0 = layer_forward_backward(layer, x, dy)
    xc = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = checkpoint(layer, xc, use_reentrant=False)
    (y * dy).sum().backward()
    assert torch.equal(y.detach(), y0) and torch.equal(xc.grad, g0["x"])
    for name, p in layer.named_parameters():
        assert torch.equal(p.grad, g0[name]), name


def test_workspace_key_group_stays_alive():
    """The cache is keyed on id(ep_group): safe only because the workspace keeps its group
    alive, so the id cannot be handed to another group while the entry exists."""
    import gc
    import weakref

    from mok_nn import functional

    class Group:  # any object: the reference backend reads the group only when it exchanges rows
        pass

    group = Group()
    ref = weakref.ref(group)
    ws = _workspace(torch.float32, ep_group=group)
    assert ws.ep_group is group
    del group, ws
    gc.collect()
    assert ref() is not None


def test_release_workspaces():
    """Released workspaces are forgotten (a fresh one next time); others of other groups stay."""
    from mok_nn import functional

    ws = _workspace(torch.float32)
    assert _workspace(torch.float32) is ws
    group_marker = object()  # stands for another ep_group: only identity matters here
    other = functional.Workspace(H, I, E, K, group_marker, torch.device("cpu"), torch.float32, "reference")
    functional._WORKSPACES[("other",)] = other
    try:
        assert functional.release_workspaces(ep_group=None) >= 2
        assert _workspace(torch.float32) is not ws
        functional._WORKSPACES[("other",)] = other
        assert functional.release_workspaces(ep_group=group_marker) == 1
        assert ("other",) not in functional._WORKSPACES
        assert any(w.ep_group is None for w in functional._WORKSPACES.values())
    finally:
        functional._WORKSPACES.pop(("other",), None)


def test_workspace_of_other_sizes_is_refused():
    """functional.forward with a workspace made for other sizes (here fewer experts, which made the ids wrap to
    other experts' rows without a word) raises, naming the workspace's sizes; get_workspace checks its own."""
    from mok_nn import functional, reference
    from mok_nn.functional import ExpertParams

    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g)
    ids = torch.topk(torch.randn(T, E, generator=g), K, dim=1).indices
    w = torch.rand(T, K, generator=g)
    params = ExpertParams(torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g), None, None)
    good = functional.get_workspace(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K,
                                    dtype=torch.float32, backend="reference")
    y, _ = functional.forward(x, ids, w, params, functional.build_schedule(ids, good), good)
    want, _ = reference.experts_forward(x, ids, w, *params.as_args())
    assert torch.equal(y, want)
    for kw in ({"num_experts": E // 2}, {"hidden_size": H + 8}, {"intermediate_size": I * 2}, {"top_k": K + 1}):
        ws = functional.get_workspace(**{**dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K,
                                                dtype=torch.float32, backend="reference"), **kw})
        with pytest.raises(ValueError, match="the workspace is for"):
            functional.forward(x, ids, w, params, None, ws)
    bad_args = [({"hidden_size": 0}, "hidden_size"), ({"top_k": E + 1}, "top_k"), ({"dtype": torch.int32}, "dtype"),
                ({"activation": "gelu"}, "activation"), ({"swiglu_limit": -1.0}, "swiglu_limit"),
                ({"config": "x"}, "config")]
    for kw, word in bad_args:
        with pytest.raises((ValueError, TypeError), match=word):
            functional.get_workspace(**{**dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K,
                                               dtype=torch.float32, backend="reference"), **kw})


def test_kernels_run_on_the_tensors_device(monkeypatch):
    """functional.on_device (around every CUDA-path call of functional and mok_nn.ops): the kernels launch on
    the current device's current stream, so a layer on cuda:1 while cuda:0 is current must make cuda:1 current
    first (it launched on the wrong GPU); on the current device or the CPU nothing is switched."""
    import contextlib

    from mok_nn import functional

    entered = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda d: entered.append(torch.device(d)) or contextlib.nullcontext())
    for dev in ("cpu", "cuda:0"):
        functional.on_device(torch.device(dev))
    assert entered == []
    functional.on_device(torch.device("cuda:1"))
    assert entered == [torch.device("cuda:1")]


def test_build_schedule_checks_the_ids_first():
    """build_schedule runs before forward's checks: it names bad topk_ids itself (int32 ids failed inside a
    kernel launch or scatter_add_ on the CUDA path, with a message about a kernel argument)."""
    from mok_nn import functional

    ws = functional.get_workspace(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, dtype=torch.float32,
                                  backend="reference")
    ids = torch.topk(torch.randn(T, E, generator=torch.Generator().manual_seed(4)), K, dim=1).indices
    for bad, word in ((ids.int(), "int64"), (ids.reshape(-1), r"\[tokens, top_k\]"), (ids[:, :1], "top_k = 1")):
        with pytest.raises(ValueError, match=word):
            functional.build_schedule(bad, ws)
    functional.build_schedule(ids, ws)  # the good ones pass


def test_backward_told_whether_its_saved_tensors_are_read_again(monkeypatch):
    """MoKFunction's backward lets the backend overwrite what the forward saved (consume_saved) only where
    autograd keeps no graph: a plain backward does, a backward with retain_graph=True does not (a second backward
    reads them again), and that second one does."""
    from mok_nn import functional

    seen, real = [], functional.backward

    def spy(*args, consume_saved=False, **kw):
        seen.append(consume_saved)
        return real(*args, consume_saved=consume_saved, **kw)

    monkeypatch.setattr(functional, "backward", spy)
    layer = make_layer(OPTS, dtype=torch.float32, seed=89)
    x = random_x((T, H), torch.float32, 90).requires_grad_(True)
    layer(x).sum().backward()
    assert seen == [True]
    seen.clear()
    x.grad = None
    y = layer(x)
    y.sum().backward(retain_graph=True)
    first = x.grad.clone()
    x.grad = None
    y.sum().backward()
    assert seen == [False, True] and torch.equal(x.grad, first)


def test_weight_scope_only_for_several_passes():
    """MoKFunction keeps trained weights' MXFP8 values across the passes of a forward or backward only where there
    are several (macrobatch): one pass asks for each once, and a scope would hold them to its end."""
    from mok_nn import mxfp8
    from mok_nn.autograd import weight_scope_for

    with weight_scope_for(1):
        assert getattr(mxfp8._SCOPE, "values", None) is None
    with weight_scope_for(3):
        assert getattr(mxfp8._SCOPE, "values", None) == {}
    assert getattr(mxfp8._SCOPE, "values", None) is None
