"""mok_nn.ops: custom ops agree with the layer's path, pass opcheck, and trace under torch.compile."""

import pytest
import torch

from mok_nn import ops, reference, router


def _inputs(dtype=torch.float64, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, H, I, E, K = 11, 16, 8, 4, 2

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()

    x, w13, w2 = rnd(T, H), rnd(E, 2 * I, H), rnd(E, H, I)
    b13, b2 = (rnd(E, 2 * I), rnd(E, H)) if bias else (None, None)
    ids, wt, _ = router.route(torch.randn(T, E, generator=g, dtype=torch.float64), K)
    return x, ids, wt.detach().to(dtype).requires_grad_(), w13, w2, b13, b2


@pytest.mark.parametrize("bias", [True, False])
def test_gradcheck(bias):
    x, ids, wt, w13, w2, b13, b2 = _inputs(bias=bias)
    params = [p for p in (x, wt, w13, w2, b13, b2) if p is not None]

    def f(*p):
        x, wt, w13, w2, *biases = p
        biases = biases if bias else [None, None]
        return ops.routed_experts(x, ids, wt, w13, w2, *biases, "swiglu_oai", 2.0)

    assert torch.autograd.gradcheck(f, params, fast_mode=True)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_matches_backend_bitwise_bf16(backend):
    from mok_nn import torch_backend

    x, ids, wt, w13, w2, b13, b2 = _inputs(dtype=torch.bfloat16)
    y = ops.routed_experts(x, ids, wt, w13, w2, b13, b2, backend=backend)
    impl = reference if backend == "reference" else torch_backend
    y_ref, _ = impl.experts_forward(x, ids, wt, w13, w2, b13, b2)
    assert torch.equal(y, y_ref)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_opcheck(backend):
    x, ids, wt, w13, w2, b13, b2 = _inputs(dtype=torch.float32)
    torch.library.opcheck(ops.routed_experts_fwd, (x, ids, wt, w13, w2, b13, b2, "swiglu", None, backend))


def test_torch_compile_fullgraph():
    x, ids, wt, w13, w2, b13, b2 = _inputs(dtype=torch.float32)
    compiled = torch.compile(ops.routed_experts, fullgraph=True, backend="aot_eager")
    y = compiled(x, ids, wt, w13, w2, b13, b2, backend="torch")  # what "auto" resolves to on CPU
    y.square().sum().backward()
    grads = [t.grad.clone() for t in (x, wt, w13)]
    for t in (x, wt, w13):
        t.grad = None
    y_eager = ops.routed_experts(x, ids, wt, w13, w2, b13, b2)
    y_eager.square().sum().backward()
    assert torch.equal(y, y_eager)
    for got, t in zip(grads, (x, wt, w13)):
        assert torch.equal(got, t.grad)


def test_backend_choice():
    x, ids, wt, w13, w2, b13, b2 = _inputs(dtype=torch.float32)
    assert ops.resolve_backend("auto", x, ids, w13, w2, "swiglu") == "torch"  # CPU input: the portable backend
    with pytest.raises(RuntimeError, match="backend='cuda' cannot run"):
        ops.routed_experts(x, ids, wt, w13, w2, backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.routed_experts(x, ids, wt, w13, w2, backend="triton")


def test_autocast_does_not_change_the_ops():
    """Under autocast the ops still compute in the inputs' dtype (as MoKFunction does)."""
    x, ids, wt, w13, w2, b13, b2 = _inputs(dtype=torch.float32)
    leaves = (x, wt, w13, w2, b13, b2)
    y0 = ops.routed_experts(x, ids, wt, w13, w2, b13, b2)
    y0.square().sum().backward()
    g0 = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ops.routed_experts(x, ids, wt, w13, w2, b13, b2)
    y.square().sum().backward()
    assert torch.equal(y, y0)
    for t, g in zip(leaves, g0):
        assert torch.equal(t.grad, g)


@pytest.mark.parametrize("opts", [
    dict(aux_loss_coef=0.01, z_loss_coef=0.001),
    dict(score_func="sigmoid", n_group=4, topk_group=2, use_expert_bias=True, shared_intermediate_size=16,
         shared_expert_gate=True, expert_proj_bias=True, activation="swiglu_oai", swiglu_limit=3.0),
])
def test_layer_compiles_fullgraph_with_the_same_bits(opts):
    """torch.compile(layer, fullgraph=True) traces the whole layer (experts as custom ops) and
    gives the eager bits: output, aux loss and every gradient."""
    from mok_nn import MoKMoELayer

    torch.manual_seed(0)
    layer = MoKMoELayer(32, 16, 8, 2, dtype=torch.float32, **opts)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(1))

    def run(fn):
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        y = fn(xx)
        loss = y.square().sum() + (layer.aux_loss if layer.aux_loss is not None else 0.0)
        loss.backward()
        aux = None if layer.aux_loss is None else layer.aux_loss.detach()
        return [y.detach(), xx.grad, aux] + [p.grad.clone() for p in layer.parameters()]

    compiled = run(torch.compile(layer, fullgraph=True, backend="aot_eager"))
    eager = run(layer)
    assert len(compiled) == len(eager)
    for got, want in zip(compiled, eager):
        assert (got is None and want is None) or torch.equal(got, want)


def _inductor_cpu_missing() -> str | None:
    """Why the default inductor backend cannot compile C++ for the CPU here (None: it can)."""
    import os
    import sysconfig

    try:
        from torch._inductor import cpp_builder

        cpp_builder.get_cpp_compiler()
    except Exception as err:  # no C++ compiler found (InvalidCxxCompiler) or an unexpected torch layout
        return f"no C++ compiler for inductor: {type(err).__name__}"
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        return "no Python headers (Python.h) for inductor"
    return None


def test_layer_compiles_with_inductor_within_rounding():
    """With the default inductor backend the torch ops around the custom ops (router, shared expert,
    top-k weights) are fused and reordered, so fp32 results are not the eager bits; they agree within
    1e-5 of each tensor's largest magnitude (observed about 4e-7) for the output and every gradient."""
    reason = _inductor_cpu_missing()
    if reason:
        pytest.skip(reason)
    from mok_nn import MoKMoELayer

    torch.manual_seed(0)
    layer = MoKMoELayer(32, 16, 8, 2, dtype=torch.float32, score_func="sigmoid", n_group=4, topk_group=2,
                        use_expert_bias=True, shared_intermediate_size=16, shared_expert_gate=True,
                        expert_proj_bias=True, activation="swiglu_oai", swiglu_limit=3.0, aux_loss_coef=0.01)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(3))

    def run(fn):
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        y = fn(xx)
        (y.square().sum() + layer.aux_loss).backward()
        return [y.detach(), xx.grad, layer.aux_loss.detach()] + [p.grad.clone() for p in layer.parameters()]

    torch._dynamo.reset()
    compiled = run(torch.compile(layer, fullgraph=True))  # backend="inductor", the default
    eager = run(layer)
    assert len(compiled) == len(eager)
    for i, (got, want) in enumerate(zip(compiled, eager)):
        scale = want.abs().max().item()
        assert scale > 0
        err = (got - want).abs().max().item()
        assert err <= 1e-5 * scale, f"tensor {i}: max |compiled - eager| = {err:.3g}, largest |eager| = {scale:.3g}"


@pytest.mark.parametrize("size", [10, 4])
def test_layer_compiles_with_macrobatch_passes(size):
    """Under torch.compile a macrobatch config runs one custom-op call per pass: the eager layer's bits
    for y and d x (the same passes). The expert gradients: the eager bits with two passes (a + b == b + a),
    and with five (autograd sums them in its own order) close to eager and the same on a second run."""
    from mok_nn import MoKConfig, MoKMoELayer

    torch.manual_seed(0)
    layer = MoKMoELayer(32, 16, 8, 2, dtype=torch.float32, config=MoKConfig(minibatch_size=1, macrobatch_size=size))
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(2))  # 18 tokens: passes 10 + 8, or 4 x 4 + 2
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")

    def run(fn):
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        y = fn(xx)
        y.square().sum().backward()
        return [y.detach(), xx.grad] + [p.grad.clone() for p in layer.parameters()]

    got, want, again = run(compiled), run(layer), run(compiled)
    names = ["y", "x"] + [n for n, _ in layer.named_parameters()]
    for name, g, w, a in zip(names, got, want, again):
        assert torch.equal(g, a), f"{name}: not reproducible"
        if size == 10 or not name.startswith("experts."):
            assert torch.equal(g, w), name
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_opcheck_backward_with_non_contiguous_inputs():
    """The backward op's fake gives contiguous d x and d topk-weights, as both backends return them, also for a
    transposed (non-contiguous) x and topk_weights: an empty_like fake kept their strides, opcheck reported a
    stride mismatch and inductor asserted on it."""
    x, ids, wt, w13, w2, b13, b2 = _inputs(dtype=torch.float32)
    xt = x.detach().t().contiguous().t()  # same values, column-major
    wtt = wt.detach().t().contiguous().t()
    assert not xt.is_contiguous() and not wtt.is_contiguous()
    y, gate_up = ops.routed_experts_fwd(xt, ids, wtt, w13.detach(), w2.detach(), None, None, "swiglu", None,
                                        "reference")
    args = (torch.randn_like(y), xt, ids, wtt, gate_up, w13.detach(), w2.detach(), None, None, "swiglu", None,
            "reference")
    torch.library.opcheck(ops.routed_experts_bwd, args)


@pytest.mark.parametrize("case", ["x3d", "ids_int32", "ids_rows", "weights_shape", "hidden", "down_shape",
                                  "bias_shape", "mixed_dtype", "limit", "activation"])
def test_bad_arguments_are_named(case):
    """routed_experts checks shapes, dtypes and settings before anything runs, naming the argument."""
    x, ids, wt, w13, w2, b13, b2 = (t.detach() if isinstance(t, torch.Tensor) else t
                                    for t in _inputs(dtype=torch.float32))
    args = dict(x=x, topk_ids=ids, topk_weights=wt, gate_up_proj=w13, down_proj=w2, gate_up_bias=b13, down_bias=b2,
                activation="swiglu", swiglu_limit=None, backend="reference")
    bad, word = {
        "x3d": ({"x": x.unsqueeze(0)}, "x must be"),
        "ids_int32": ({"topk_ids": ids.int()}, "topk_ids must be int64"),
        "ids_rows": ({"topk_ids": ids[:-1]}, "topk_ids must be"),
        "weights_shape": ({"topk_weights": wt[:, :1]}, "topk_weights must have"),
        "hidden": ({"x": x[:, :-1]}, "hidden size"),
        "down_shape": ({"down_proj": w2[:, :, :-1]}, "down_proj must be"),
        "bias_shape": ({"down_bias": b2[:, :-1]}, "down_bias must be"),
        "mixed_dtype": ({"x": x.double()}, "share one dtype"),
        "limit": ({"swiglu_limit": -1.0}, "swiglu_limit"),
        "activation": ({"activation": "gelu"}, "activation must be"),
    }[case]
    with pytest.raises((ValueError, TypeError), match=word):
        ops.routed_experts(**{**args, **bad})


def test_reference_rejects_expert_ids_out_of_range():
    """An id outside [0, E) used to wrap to another expert's rows on the reference path (no error, wrong y)."""
    x, ids, wt, w13, w2, b13, b2 = _inputs(dtype=torch.float32)
    for bad_value in (w13.shape[0], w13.shape[0] + 3, -1):
        bad = ids.clone()
        bad[3, 1] = bad_value
        with pytest.raises(ValueError, match=r"topk_ids must lie in \[0, 4\)"):
            ops.routed_experts(x, bad, wt, w13, w2, b13, b2, backend="reference")


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_mxfp8_precision_through_the_ops(backend):
    """precision="mxfp8" through the custom ops: the backend's MXFP8 forward and backward bit for bit (MoKFunction's
    path), opcheck passes, and it is not the bf16 result."""
    from mok_nn import functional
    from mok_nn.autograd import MoKFunction

    g = torch.Generator().manual_seed(3)
    T, H, I, E, K = 21, 64, 32, 4, 2
    x = torch.randn(T, H, generator=g).bfloat16().requires_grad_()
    w13 = (torch.randn(E, 2 * I, H, generator=g) / 8).bfloat16().requires_grad_()
    w2 = (torch.randn(E, H, I, generator=g) / 6).bfloat16().requires_grad_()
    ids, wt, _ = router.route(torch.randn(T, E, generator=g), K)
    wt = wt.requires_grad_()
    dy = torch.randn(T, H, generator=g).bfloat16()

    def run(f):
        for t in (x, wt, w13, w2):
            t.grad = None
        y = f()
        y.backward(dy)
        return [y.detach()] + [t.grad.clone() for t in (x, wt, w13, w2)]

    got = run(lambda: ops.routed_experts(x, ids, wt, w13, w2, backend=backend, precision="mxfp8"))
    ws = functional.get_workspace(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, dtype=x.dtype,
                                  backend=backend, precision="mxfp8")
    want = run(lambda: MoKFunction.apply(x, wt, w13, w2, None, None, ids, ws))
    plain = run(lambda: ops.routed_experts(x, ids, wt, w13, w2, backend=backend))
    for a, b, c in zip(got, want, plain):
        assert torch.equal(a, b) and not torch.equal(a, c)
    torch.library.opcheck(ops.routed_experts_fwd, (x.detach().float(), ids, wt.detach(), w13.detach().float(),
                                                   w2.detach().float(), None, None, "swiglu", None, backend, "mxfp8"))


def test_mxfp8_precision_arguments_are_checked():
    x, ids, wt, w13, w2, _, _ = _inputs(dtype=torch.float32, bias=False)  # H = 16: not a multiple of 32
    with pytest.raises(ValueError, match="multiples of 32"):
        ops.routed_experts(x, ids, wt, w13, w2, precision="mxfp8")
    with pytest.raises(ValueError, match="precision"):
        ops.routed_experts(x, ids, wt, w13, w2, precision="fp8")


def test_mxfp8_layer_compiles_fullgraph_with_the_same_bits():
    """precision="mxfp8" under torch.compile(fullgraph=True): the experts go through the custom ops with the
    precision, the eager layer's bits (output and every gradient)."""
    from mok_nn import MoKMoELayer

    torch.manual_seed(0)
    layer = MoKMoELayer(64, 32, 8, 2, dtype=torch.bfloat16, precision="mxfp8")
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(1)).bfloat16()

    def run(fn):
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        y = fn(xx)
        y.float().square().sum().backward()
        return [y.detach(), xx.grad] + [p.grad.clone() for p in layer.parameters()]

    compiled = run(torch.compile(layer, fullgraph=True, backend="aot_eager"))
    eager = run(layer)
    plain = MoKMoELayer(64, 32, 8, 2, dtype=torch.bfloat16)
    plain.load_state_dict(layer.state_dict())
    assert not torch.equal(plain(x), eager[0])  # (MXFP8, not bf16)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)
