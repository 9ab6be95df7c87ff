"""MoKMoELayer (reference backend) against the float64 oracle: outputs, router
logits and every gradient, for every routing and activation option; gradcheck;
bitwise run-to-run determinism."""

import pytest
import torch

import oracle
from helpers import (ACTIVATIONS, E, H, ROUTINGS, assert_close, layer_forward_backward, make_layer,
                     oracle_forward_backward, oracle_kwargs, random_x, single_thread)  # noqa: F401

T = 13  # odd on purpose

# Tolerances, relative to each tensor's largest magnitude. float64: the layer
# must compute in float64 (gradcheck needs it); only the order of sums differs
# from the oracle (measured: ~1.5e-15). float32: a few ulps of fp32
# (2^-23 ~ 1.2e-7) grown over H-long dot products and the softmax /
# normalisation chain (measured: <= 6.1e-7 over all cases).
TOL = {torch.float64: 1e-12, torch.float32: 5e-6}
# Routing must be the same in every precision: the smallest gap between a
# selected and a rejected score (or group score) must dwarf rounding.
MIN_MARGIN = 1e-5


def _check_against_oracle(opts, dtype, x_shape, seed):
    layer = make_layer(opts, dtype=dtype, seed=seed)
    x = random_x(x_shape, dtype, seed + 1)
    dy = random_x(x_shape, dtype, seed + 2)
    y, grads = layer_forward_backward(layer, x, dy)
    res, ref_grads = oracle_forward_backward(layer, opts, x, dy)
    assert res.margin > MIN_MARGIN, "test input has a near-tie in routing; pick another seed"

    tol = TOL[dtype]
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, res.y, tol, "y")
    logits = layer.router_logits
    assert logits.shape == (res.logits.shape[0], E)
    assert logits.dtype in (torch.float32, torch.float64)
    assert_close(logits, res.logits, max(tol, 1e-6 if logits.dtype == torch.float32 else 0), "router_logits")
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        assert g is not None, f"no gradient for {name}"
        assert g.dtype == dtype, f"gradient of {name} has dtype {g.dtype}"
        assert_close(g, ref_grads[name], tol, f"grad {name}")
    # Aux losses are off by default.
    assert layer.aux_loss is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_matches_oracle(routing, act, dtype):
    opts = {**ROUTINGS[routing], **ACTIVATIONS[act]}
    _check_against_oracle(opts, dtype, (T, H), seed=10)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_matches_oracle_3d_input_all_options(dtype):
    """x [B, S, H] -> y [B, S, H], everything switched on at once."""
    opts = {**ROUTINGS["sigmoid_group_bias"], **ACTIVATIONS["oai_limit"], "shared_intermediate_size": 20,
            "shared_expert_gate": True}
    _check_against_oracle(opts, dtype, (3, 5, H), seed=20)


EDGE_CASES = {
    "k_equals_E": dict(experts=4, top_k=4, opts=ROUTINGS["softmax_norm"]),
    "k1_norm": dict(experts=4, top_k=1, opts=ROUTINGS["sigmoid_norm_scaled"]),
    "one_expert_per_group": dict(experts=8, top_k=2, opts={**ROUTINGS["sigmoid_group_bias"], "n_group": 8,
                                                           "topk_group": 3}),
    "single_group": dict(experts=8, top_k=3, opts={**ROUTINGS["softmax_group"], "n_group": 1, "topk_group": 1}),
}


@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("case", list(EDGE_CASES))
def test_edge_shapes_match_oracle(case, tokens):
    c = EDGE_CASES[case]
    opts = {**c["opts"], **ACTIVATIONS["shared_gate"]}
    layer = make_layer(opts, dtype=torch.float64, seed=110, experts=c["experts"], top_k=c["top_k"], hidden=12,
                       inter=10)
    x = random_x((tokens, 12), torch.float64, 111)
    dy = random_x((tokens, 12), torch.float64, 112)
    y, grads = layer_forward_backward(layer, x, dy)
    res, ref_grads = oracle_forward_backward(layer, opts, x, dy, top_k=c["top_k"])
    assert res.margin > MIN_MARGIN
    assert_close(y, res.y, TOL[torch.float64], "y")
    for name, g in grads.items():
        assert_close(g, ref_grads[name], TOL[torch.float64], f"grad {name}")


def test_bf16_close_to_oracle():
    """bf16 storage: loose check that nothing is grossly wrong (bf16 has 8 bits
    of mantissa, 2^-8 ~ 4e-3, and the expert intermediate is rounded too)."""
    opts = {**ROUTINGS["softmax_norm"], **ACTIVATIONS["shared_gate"]}
    layer = make_layer(opts, dtype=torch.bfloat16, seed=30)
    x = random_x((T, H), torch.bfloat16, 31)
    dy = random_x((T, H), torch.bfloat16, 32)
    y, grads = layer_forward_backward(layer, x, dy)
    res, ref_grads = oracle_forward_backward(layer, opts, x, dy)
    assert res.margin > MIN_MARGIN  # logits are fp32 of the same bf16 values: no flip
    assert y.dtype == torch.bfloat16
    assert layer.router_logits.dtype == torch.float32
    assert_close(y, res.y, 3e-2, "y")
    for name, g in grads.items():
        assert g is not None and g.dtype == torch.bfloat16, name
        assert_close(g, ref_grads[name], 5e-2, f"grad {name}")


def test_swiglu_oai_without_limit_does_not_clamp():
    """swiglu_limit=None means no clamp for every activation (GPT-OSS's 7.0 is
    passed explicitly by its integration); the test input has gate/up values beyond 7."""
    opts = {**ROUTINGS["softmax"], "activation": "swiglu_oai"}
    x = random_x((T, H), torch.float64, 11)
    y_default = make_layer(opts, seed=10)(x)
    y_7 = make_layer({**opts, "swiglu_limit": 7.0}, seed=10)(x)
    y_off = make_layer({**opts, "swiglu_limit": 1e9}, seed=10)(x)
    assert not torch.equal(y_7, y_off), "test input never reaches the limit"
    assert torch.equal(y_default, y_off)


# --- the test inputs exercise what they claim to (so the tests above can fail)


def _oracle_only(opts, seed=10, **okw):
    layer = make_layer(opts, dtype=torch.float64, seed=seed)
    x = random_x((T, H), torch.float64, seed + 1)
    p = {k: v.to(torch.float64) for k, v in layer.state_dict().items()}
    return oracle.oracle_forward(x, p, **oracle_kwargs(opts), **okw)


def test_inputs_exercise_options():
    # The selection bias changes which experts are picked.
    opts = ROUTINGS["sigmoid_bias"]
    assert _oracle_only(opts).topk_ids != _oracle_only(opts, use_expert_bias=False).topk_ids
    # Group-limited routing picks differently from plain top-k.
    opts = ROUTINGS["softmax_group"]
    plain = {k: v for k, v in opts.items() if k not in ("n_group", "topk_group")}
    assert _oracle_only(opts).topk_ids != _oracle_only(plain).topk_ids
    # The clamp limits are reached: clamping changes the output.
    for act in ("swiglu_clamp", "oai", "oai_limit"):
        opts = {**ROUTINGS["softmax"], **ACTIVATIONS[act]}
        clamped = _oracle_only(opts).y
        limit = 1e9
        loose = _oracle_only({**opts, "swiglu_limit": limit}).y
        assert not torch.allclose(clamped, loose, rtol=1e-6, atol=1e-6), act


# --- gradcheck in float64 on small shapes


GRADCHECK_CASES = {
    "softmax_group_clamp": {**ROUTINGS["softmax_group"], **ACTIVATIONS["swiglu_clamp"]},
    "sigmoid_group_bias_oai_shared_gate": {**ROUTINGS["sigmoid_group_bias"], **ACTIVATIONS["oai_limit"],
                                           "shared_intermediate_size": 5, "shared_expert_gate": True},
    "softmax_nonorm_swiglu": {**ROUTINGS["softmax"], **ACTIVATIONS["swiglu"]},
}


@pytest.mark.parametrize("case", list(GRADCHECK_CASES))
def test_gradcheck_layer(case):
    from torch.func import functional_call

    opts = GRADCHECK_CASES[case]
    layer = make_layer(opts, dtype=torch.float64, seed=40, hidden=6, inter=5, experts=8, top_k=2)
    x = random_x((5, 6), torch.float64, 41).requires_grad_(True)
    names = [n for n, _ in layer.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for _, p in layer.named_parameters()]
    buffers = dict(layer.named_buffers())

    # The perturbations of gradcheck (1e-6) must not change the routing.
    p64 = {k: v.detach() for k, v in layer.state_dict().items()}
    margin = oracle.oracle_forward(x.detach(), p64, **oracle_kwargs(opts, top_k=2)).margin
    assert margin > 1e-4

    def f(x, *ps):
        return functional_call(layer, {**dict(zip(names, ps)), **buffers}, (x,))

    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("activation,limit", [("swiglu", None), ("swiglu", 0.8), ("swiglu_oai", 0.8)])
def test_gradcheck_mokfunction(activation, limit):
    """MoKFunction's explicit backward, all six differentiable inputs, with
    repeated experts and an expert no token picks."""
    from mok_nn import functional
    from mok_nn.autograd import MoKFunction

    Tn, Hn, In, En, k = 5, 4, 3, 4, 2
    ws = functional.get_workspace(hidden_size=Hn, intermediate_size=In, num_experts=En, top_k=k,
                                  dtype=torch.float64, backend="reference", activation=activation,
                                  swiglu_limit=limit)
    g = torch.Generator().manual_seed(90)
    r = lambda *s, std=1.0: (torch.randn(*s, generator=g, dtype=torch.float64) * std).requires_grad_(True)  # noqa
    x, w = r(Tn, Hn), r(Tn, k)
    gu, dp, gub, db = r(En, 2 * In, Hn, std=0.8), r(En, Hn, In), r(En, 2 * In), r(En, Hn)
    ids = torch.tensor([[2, 0], [0, 2], [1, 2], [2, 1], [0, 1]])  # expert 3 unused
    if limit is not None:  # the clamp is active on this input
        flat = ids.reshape(-1)
        pre = torch.einsum("toh,th->to", gu.detach()[flat], x.detach().repeat_interleave(k, 0)) + gub.detach()[flat]
        assert (pre.abs() > limit).any()

    def f(x, w, gu, dp, gub, db):
        return MoKFunction.apply(x, w, gu, dp, gub, db, ids, ws)

    assert torch.autograd.gradcheck(f, (x, w, gu, dp, gub, db), eps=1e-6, atol=1e-7, rtol=1e-5)


# --- determinism: bitwise identical outputs and gradients run after run


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_bitwise_deterministic(dtype):
    torch.set_num_threads(2)  # the default of a 2-core machine
    try:
        _check_deterministic(dtype)
    finally:
        torch.set_num_threads(1)


def _check_deterministic(dtype):
    opts = {**ROUTINGS["sigmoid_group_bias"], **ACTIVATIONS["oai"], "shared_intermediate_size": 20,
            "shared_expert_gate": True}
    runs = []
    for _ in range(2):
        layer = make_layer(opts, dtype=dtype, seed=50)
        x = random_x((257, H), dtype, 51)
        dy = random_x((257, H), dtype, 52)
        y, grads = layer_forward_backward(layer, x, dy)
        y2, grads2 = layer_forward_backward(layer, x, dy)  # same module instance again
        runs += [(y, grads, layer.router_logits.clone()), (y2, grads2, layer.router_logits.clone())]
    y0, g0, l0 = runs[0]
    for y, g, logits in runs[1:]:
        assert torch.equal(y, y0)
        assert torch.equal(logits, l0)
        assert set(g) == set(g0)
        for name in g0:
            assert torch.equal(g[name], g0[name]), name


# --- routing: ties go to the lower expert index


def test_route_ties_to_lower_index():
    from mok_nn.router import route

    T_, E_, k = 5, 8, 3
    logits = torch.zeros(T_, E_)
    ids, w = route(logits, k, "softmax", False, None, None, 1.0, None)[:2]
    assert ids.dtype == torch.int64 and ids.shape == (T_, k)
    assert w.dtype == torch.float32 and w.shape == (T_, k)
    for t in range(T_):
        assert sorted(ids[t].tolist()) == [0, 1, 2]
    # Equal scores on experts 5 and 2 and 7: after the clear winner 6, pick 2 then 5.
    logits = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 3.0, 1.0]])
    ids = route(logits, k, "sigmoid", True, None, None, 1.0, None)[0]
    assert sorted(ids[0].tolist()) == [2, 5, 6]
    # Group-limited with tied groups: groups (0,1) (2,3) (4,5) (6,7) all equal -> groups 0 and 1.
    logits = torch.tensor([[1.0, 0.5, 0.5, 1.0, 1.0, 0.5, 0.5, 1.0]])
    ids = route(logits, 2, "sigmoid", True, 4, 2, 1.0, None)[0]
    assert sorted(ids[0].tolist()) == [0, 3]
    # The selection bias decides, and makes a tie: scores + bias are 0.38, 0.75,
    # 0.0067, 0.75 -> expert 1 (lower of the tied 1 and 3), not expert 0.
    logits = torch.tensor([[2.0, 0.0, -5.0, 0.0]])
    bias = torch.tensor([-0.5, 0.25, 0.0, 0.25])
    ids, w = route(logits, 1, "sigmoid", False, None, None, 1.0, bias)[:2]
    assert ids[0].tolist() == [1]
    # The weight comes from the unbiased score.
    assert w[0, 0].item() == pytest.approx(0.5, rel=1e-6)


# --- aux losses: Switch load balancing (+ router z-loss), off by default


def _aux_arg_names():
    """The constructor's names of the two loss coefficients (not fixed by
    ARCHITECTURE.md): the parameter containing "aux" and the one containing "z_loss"."""
    import inspect

    from mok_nn import MoKMoELayer

    params = inspect.signature(MoKMoELayer.__init__).parameters
    aux = [n for n in params if "aux" in n]
    z = [n for n in params if "z_loss" in n]
    assert len(aux) == 1 and len(z) == 1, f"cannot identify the loss coefficients among {list(params)}"
    return aux[0], z[0]


@pytest.mark.parametrize("routing,aux_coef,z_coef", [
    ("softmax_group", 0.01, 0.0), ("softmax_group", 0.0, 1e-3), ("softmax_group", 0.02, 1e-3),
    ("sigmoid_group_bias", 0.02, 1e-3),
])
def test_aux_loss(routing, aux_coef, z_coef):
    aux_name, z_name = _aux_arg_names()
    opts = {**ROUTINGS[routing], **ACTIVATIONS["swiglu"]}
    layer = make_layer(opts, dtype=torch.float64, seed=70, **{aux_name: aux_coef, z_name: z_coef})
    x = random_x((T, H), torch.float64, 71).requires_grad_(True)
    dy = random_x((T, H), torch.float64, 72)
    y = layer(x)
    aux = layer.aux_loss
    assert aux is not None and aux.shape == () and aux.requires_grad
    ((y * dy).sum() + aux).backward()

    p = {k: v.detach().clone().requires_grad_(k == "router.weight") for k, v in layer.state_dict().items()}
    x64 = x.detach().clone().requires_grad_(True)
    res = oracle.oracle_forward(x64, p, **oracle_kwargs(opts))
    expected = (oracle.switch_aux_loss(res.logits, res.topk_ids, E, aux_coef, opts["score_func"])
                + oracle.z_loss(res.logits, z_coef))
    assert_close(aux.detach(), expected.detach(), 1e-10, "aux_loss")
    ((res.y * dy).sum() + expected).backward()
    assert_close(layer.router.weight.grad, p["router.weight"].grad, 1e-10, "grad router.weight")
    assert_close(x.grad, x64.grad, 1e-10, "grad x")
    # Balanced routing gives 1 * coef: a check of the normalisation independent of the oracle.
    if z_coef == 0.0:
        assert 0.5 * aux_coef < aux.item() < 3 * aux_coef


# --- the same function whichever way it is called


def test_same_result_auto_backend_config_knobs_no_grad():
    """On CPU backend="auto" is the portable backend (backend="torch"); MoKConfig knobs change
    speed, never the function; inference (no_grad, x without grad) gives the
    training-mode output. All bit for bit."""
    from mok_nn import MoKConfig

    opts = {**ROUTINGS["sigmoid_group_bias"], **ACTIVATIONS["shared_gate"]}
    x = random_x((T, H), torch.float32, 101)
    dy = random_x((T, H), torch.float32, 102)
    cases = {
        "auto": (make_layer(opts, dtype=torch.float32, seed=100, backend="torch"),
                 make_layer(opts, dtype=torch.float32, seed=100, backend="auto")),
        # (macrobatch_size splits the tokens into passes: tests/test_macrobatch.py; the expert
        # gradients are then summed per pass, and CPU BLAS rounds rows by the row count)
        "knobs": (make_layer(opts, dtype=torch.float32, seed=100),
                  make_layer(opts, dtype=torch.float32, seed=100, config=MoKConfig(
                      fwd_num_comm_sms=0, bwd_num_comm_sms=0, minibatch_size=1, schedule_capacity_multiplier=7.5))),
    }
    for what, (base, layer) in cases.items():
        y0, g0 = layer_forward_backward(base, x, dy)
        y, g = layer_forward_backward(layer, x, dy)
        assert torch.equal(y, y0), what
        for name in g0:
            assert torch.equal(g[name], g0[name]), f"{what}: {name}"
        with torch.no_grad():
            assert torch.equal(layer(x), y0), what
        assert torch.equal(layer(x).detach(), y0), what  # x without grad, parameters with


# --- the state-dict contract of ARCHITECTURE.md


def test_state_dict_names_and_shapes():
    from mok_nn import MoKMoELayer

    Hn, In, En, Sn = 12, 10, 8, 6
    plain = MoKMoELayer(hidden_size=Hn, intermediate_size=In, num_experts=En, top_k=2, backend="reference",
                        dtype=torch.float32)
    assert {k: tuple(v.shape) for k, v in plain.state_dict().items()} == {
        "router.weight": (En, Hn), "experts.gate_up_proj": (En, 2 * In, Hn), "experts.down_proj": (En, Hn, In)}
    full = MoKMoELayer(hidden_size=Hn, intermediate_size=In, num_experts=En, top_k=2, use_expert_bias=True,
                       shared_intermediate_size=Sn, shared_expert_gate=True, expert_proj_bias=True,
                       backend="reference", dtype=torch.float32)
    assert {k: tuple(v.shape) for k, v in full.state_dict().items()} == {
        "router.weight": (En, Hn), "router.e_score_correction_bias": (En,),
        "experts.gate_up_proj": (En, 2 * In, Hn), "experts.down_proj": (En, Hn, In),
        "experts.gate_up_proj_bias": (En, 2 * In), "experts.down_proj_bias": (En, Hn),
        "shared_expert.gate_proj.weight": (Sn, Hn), "shared_expert.up_proj.weight": (Sn, Hn),
        "shared_expert.down_proj.weight": (Hn, Sn), "shared_expert_gate.weight": (1, Hn)}
    # The correction bias is a buffer (selection only), not a trained parameter.
    assert "router.e_score_correction_bias" not in dict(full.named_parameters())


def test_init_is_seeded_and_not_degenerate():
    from mok_nn import MoKMoELayer

    def build():
        torch.manual_seed(123)
        return MoKMoELayer(hidden_size=12, intermediate_size=10, num_experts=8, top_k=2, shared_intermediate_size=6,
                           backend="reference", dtype=torch.float32)

    a, b = build().state_dict(), build().state_dict()
    for name in a:
        assert torch.equal(a[name], b[name]), name
        assert torch.isfinite(a[name]).all() and a[name].abs().max() > 0, name


def test_auto_backend_logs_fallback_once(caplog, monkeypatch):
    """backend="auto" takes the portable backend on CPU and says why, once per process
    (not once per layer: a deep model would repeat it for every layer)."""
    from mok_nn import layer as layer_module

    monkeypatch.setattr(layer_module, "_LOGGED_FALLBACKS", set())
    layer = make_layer(ROUTINGS["softmax"], dtype=torch.float32, seed=120, backend="auto")
    other = make_layer(ROUTINGS["softmax"], dtype=torch.float32, seed=122, backend="auto")
    x = random_x((T, H), torch.float32, 121)
    with caplog.at_level("DEBUG", logger="mok_nn"):
        layer(x)
        layer(x)
        other(x)
    records = [r for r in caplog.records if r.name.startswith("mok_nn") and "portable" in r.getMessage()]
    assert len(records) == 1, [r.getMessage() for r in caplog.records]


def test_deepcopy_and_pickle_after_a_training_forward():
    """router_logits / aux_loss of the last forward carry an autograd graph; copying the
    module (EMA models, copy.deepcopy of a model) must still work, and the copy does not
    carry the original's last-forward tensors."""
    import copy
    import io

    layer = make_layer({**ROUTINGS["softmax_norm"], **ACTIVATIONS["swiglu"]}, dtype=torch.float32, seed=130,
                       aux_loss_coef=0.01)
    x = random_x((T, H), torch.float32, 131).requires_grad_(True)
    layer(x)
    assert layer.router_logits.grad_fn is not None and layer.aux_loss.grad_fn is not None
    twin = copy.deepcopy(layer)
    assert twin.router_logits is None and twin.aux_loss is None
    assert layer.router_logits is not None and layer.aux_loss is not None
    x2 = random_x((T, H), torch.float32, 132)
    assert torch.equal(twin(x2), layer(x2))
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.router_logits is None
    assert torch.equal(loaded(x2), layer(x2))


@pytest.mark.parametrize("kw,word", [
    (dict(n_group=4.0, topk_group=2), "n_group"),
    (dict(n_group=4, topk_group=1.5), "topk_group"),
    (dict(top_k=True), "top_k"),
])
def test_non_int_sizes_rejected_at_construction(kw, word):
    from mok_nn import MoKMoELayer

    args = dict(hidden_size=H, intermediate_size=8, num_experts=E, top_k=2, backend="reference",
                dtype=torch.float32)
    args.update(kw)
    with pytest.raises((TypeError, ValueError), match=word):
        MoKMoELayer(**args)


@pytest.mark.parametrize("kw,exc,word", [
    (dict(shared_intermediate_size=1.5), TypeError, "shared_intermediate_size"),
    (dict(shared_intermediate_size=None), TypeError, "shared_intermediate_size"),
    (dict(shared_intermediate_size=-4), ValueError, "shared_intermediate_size"),
    (dict(routed_scaling_factor=float("nan")), ValueError, "routed_scaling_factor"),
    (dict(routed_scaling_factor=0.0), ValueError, "routed_scaling_factor"),
    (dict(routed_scaling_factor=-2.5), ValueError, "routed_scaling_factor"),
    (dict(routed_scaling_factor=float("inf")), ValueError, "routed_scaling_factor"),
    (dict(routed_scaling_factor="2.5"), TypeError, "routed_scaling_factor"),
    (dict(norm_topk_prob="no"), TypeError, "norm_topk_prob"),
    (dict(norm_topk_prob=None), TypeError, "norm_topk_prob"),
    (dict(norm_topk_prob=1), TypeError, "norm_topk_prob"),
    (dict(shared_intermediate_size=8, shared_expert_gate="no"), TypeError, "shared_expert_gate"),
    (dict(use_expert_bias="yes"), TypeError, "use_expert_bias"),
    (dict(expert_proj_bias=0), TypeError, "expert_proj_bias"),
    (dict(router_bias="False"), TypeError, "router_bias"),
    (dict(hidden_size=32.0), TypeError, "hidden_size"),
    (dict(dtype=torch.float8_e4m3fn), ValueError, "dtype"),
    (dict(dtype=torch.float8_e5m2), ValueError, "dtype"),
    (dict(dtype=torch.complex64), ValueError, "dtype"),
    (dict(swiglu_limit="1", activation="swiglu_oai"), TypeError, "swiglu_limit"),
    (dict(swiglu_limit=-1.0, activation="swiglu_oai"), ValueError, "swiglu_limit"),
    (dict(aux_loss_coef="a"), TypeError, "aux_loss_coef"),
    (dict(aux_loss_coef=-1.0), ValueError, "aux_loss_coef"),
    (dict(z_loss_coef=float("nan")), ValueError, "z_loss_coef"),
])
def test_bad_constructor_arguments_name_the_argument(kw, exc, word):
    """Each bad argument raises at construction, naming it, instead of failing deep inside
    (shared_intermediate_size, float8 dtypes) or being accepted (non-positive or NaN scaling,
    truthy non-bools)."""
    from mok_nn import MoKMoELayer

    args = dict(hidden_size=H, intermediate_size=8, num_experts=E, top_k=2, backend="reference",
                dtype=torch.float32)
    args.update(kw)
    with pytest.raises(exc, match=word):
        MoKMoELayer(**args)


def test_numpy_integers_and_floats_are_accepted():
    """Integral numbers (operator.index: numpy integers) are sizes like ints; the layer built from
    them is the one built from Python numbers (same parameters and outputs), its sizes plain ints."""
    import numpy as np

    opts = dict(score_func="sigmoid", norm_topk_prob=np.bool_(True), shared_intermediate_size=np.int32(8),
                shared_expert_gate=True, use_expert_bias=True)
    plain = dict(opts, norm_topk_prob=True, shared_intermediate_size=8)
    a = make_layer(opts, dtype=torch.float32, seed=5, hidden=np.int64(H), inter=np.int64(8), experts=np.int16(E),
                   top_k=np.int64(2), n_group=np.int64(2), topk_group=np.int8(1), routed_scaling_factor=np.float32(2.5))
    b = make_layer(plain, dtype=torch.float32, seed=5, hidden=H, inter=8, experts=E, top_k=2, n_group=2,
                   topk_group=1, routed_scaling_factor=2.5)
    for name in ("hidden_size", "intermediate_size", "num_experts", "top_k", "n_group", "topk_group"):
        assert type(getattr(a, name)) is int and getattr(a, name) == getattr(b, name), name
    assert a.norm_topk_prob is True and a.routed_scaling_factor == 2.5
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    x = random_x((T, H), torch.float32, 6)
    assert torch.equal(a(x), b(x))


def test_mxfp8_with_a_non_dtype_names_the_dtype_problem():
    from mok_nn import MoKMoELayer

    with pytest.raises(ValueError, match="torch.dtype"):
        MoKMoELayer(hidden_size=64, intermediate_size=32, num_experts=4, top_k=2, precision="mxfp8",
                    dtype="bfloat16")


def test_autocast_does_not_change_router_or_experts():
    """Under autocast an fp32 layer still routes on fp32 logits and runs the routed experts in
    its parameter dtype (the explicit backward is fp32: a bf16-autocast forward would not be
    the function it differentiates). Bit for bit the result without autocast."""
    opts = {**ROUTINGS["sigmoid_group_bias"], **ACTIVATIONS["oai"]}
    layer = make_layer(opts, dtype=torch.float32, seed=140)
    x = random_x((T, H), torch.float32, 141)
    dy = random_x((T, H), torch.float32, 142)
    y0, g0 = layer_forward_backward(layer, x, dy)
    logits0 = layer.router_logits.detach()
    xa = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(xa)
    (y * dy).sum().backward()  # outside the region, as the autocast docs recommend
    g = {"x": xa.grad, **{name: p.grad for name, p in layer.named_parameters()}}
    assert layer.router_logits.dtype == torch.float32
    assert torch.equal(layer.router_logits, logits0)
    assert torch.equal(y, y0)
    for name in g0:
        assert torch.equal(g[name], g0[name]), name


def test_deferred_init_from_meta():
    """Built on the meta device, materialised with to_empty (uninitialised memory) and
    reset_parameters(): every parameter and the selection-bias buffer get their init, so
    the layer equals one built directly under the same seed."""
    from mok_nn import MoKMoELayer

    kw = dict(hidden_size=12, intermediate_size=10, num_experts=8, top_k=2, use_expert_bias=True,
              expert_proj_bias=True, router_bias=True, backend="reference", dtype=torch.float32)
    torch.manual_seed(5)
    direct = MoKMoELayer(**kw)
    meta = MoKMoELayer(**kw, device="meta").to_empty(device="cpu")
    for t in meta.state_dict().values():
        t.fill_(float("nan"))  # what uninitialised memory may hold
    torch.manual_seed(5)
    meta.reset_parameters()
    for name, t in direct.state_dict().items():
        assert torch.equal(meta.state_dict()[name], t), name


def test_selection_bias_stays_fp32_under_module_casts():
    """layer.to(bf16) / .half() cast parameters but keep router.e_score_correction_bias fp32
    (bit for bit): in bf16 the small updates of aux-loss-free balancing would round away."""
    layer = make_layer(ROUTINGS["sigmoid_bias"], dtype=torch.float32, seed=150)
    bias = layer.router.e_score_correction_bias.clone()
    assert bias.dtype == torch.float32 and not torch.equal(bias, bias.bfloat16().float())
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.to("cpu", torch.float64)):
        cast(layer)
        assert layer.router.e_score_correction_bias.dtype == torch.float32
        assert torch.equal(layer.router.e_score_correction_bias, bias)
    assert layer.router.weight.dtype == torch.float64
    layer.to("meta")
    assert layer.router.e_score_correction_bias.device.type == "meta"
