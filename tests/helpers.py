"""Shared helpers of the CPU tests: building layers with random state, running
the layer and the oracle with gradients, comparing with stated tolerances."""

import contextlib
import datetime
import math
import sys
import traceback

import pytest
import torch

import oracle

# Small shapes: big enough for uneven routing and several groups, small enough
# for the loop-based float64 oracle.
H, I, E, K = 32, 24, 16, 4

# Routing options (each a set of MoKMoELayer keyword arguments).
ROUTINGS = {
    "softmax": dict(score_func="softmax", norm_topk_prob=False),
    "softmax_norm": dict(score_func="softmax", norm_topk_prob=True),
    "softmax_router_bias": dict(score_func="softmax", norm_topk_prob=True, router_bias=True),  # GPT-OSS
    "softmax_group": dict(score_func="softmax", norm_topk_prob=True, n_group=4, topk_group=2),
    "sigmoid_norm_scaled": dict(score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5),
    "sigmoid_bias": dict(score_func="sigmoid", norm_topk_prob=False, use_expert_bias=True),
    "sigmoid_group_bias": dict(score_func="sigmoid", norm_topk_prob=True, n_group=4, topk_group=2,
                               use_expert_bias=True, routed_scaling_factor=2.5),
}

# Activation options, with the extras that go with them (shared expert, biases).
ACTIVATIONS = {
    "swiglu": dict(activation="swiglu"),
    "swiglu_clamp": dict(activation="swiglu", swiglu_limit=1.5),
    "oai": dict(activation="swiglu_oai", swiglu_limit=7.0, expert_proj_bias=True),  # GPT-OSS limit
    "oai_limit": dict(activation="swiglu_oai", swiglu_limit=2.0, expert_proj_bias=True),
    "shared": dict(activation="swiglu", shared_intermediate_size=20),
    "shared_gate": dict(activation="swiglu", shared_intermediate_size=20, shared_expert_gate=True,
                        expert_proj_bias=True),
}

# Keyword arguments of MoKMoELayer that the oracle also takes.
ORACLE_KEYS = ("score_func", "norm_topk_prob", "n_group", "topk_group", "routed_scaling_factor",
               "activation", "swiglu_limit")


def _std(name, shape):
    """Scale of the random value of a state entry: activations of order 1-3,
    peaked but not one-hot routing, gate/up often beyond the clamp limits."""
    if name == "router.weight":
        return 2.0 / math.sqrt(shape[-1])
    if name == "router.e_score_correction_bias":
        return 0.15
    if name == "experts.gate_up_proj":
        return 3.0 / math.sqrt(shape[-1])
    if name.endswith("bias"):
        return 0.5
    return 1.0 / math.sqrt(shape[-1])


def random_state(layer, seed):
    """Fresh random values (never zeros) for every floating state entry."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, v in layer.state_dict().items():
        if v.is_floating_point():
            r = torch.randn(v.shape, generator=g, dtype=torch.float64) * _std(name, v.shape)
            out[name] = r.to(v.dtype)
        else:
            out[name] = v.clone()
    return out


def make_layer(opts, dtype=torch.float64, seed=0, hidden=H, inter=I, experts=E, top_k=K, **extra):
    from mok_nn import MoKMoELayer

    kw = dict(hidden_size=hidden, intermediate_size=inter, num_experts=experts, top_k=top_k,
              backend="reference", device="cpu", dtype=dtype)
    kw.update(opts)
    kw.update(extra)
    layer = MoKMoELayer(**kw)
    layer.load_state_dict(random_state(layer, seed))
    return layer


def random_x(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def oracle_kwargs(opts, top_k=K):
    kw = {k: v for k, v in opts.items() if k in ORACLE_KEYS}
    kw["top_k"] = top_k
    return kw


def layer_forward_backward(layer, x, dy):
    """y, and the gradients of sum(y * dy) w.r.t. x and every parameter."""
    x = x.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    (y * dy).sum().backward()
    grads = {"x": x.grad}
    for name, p in layer.named_parameters():
        grads[name] = p.grad
    return y.detach(), grads


def oracle_forward_backward(layer, opts, x, dy, top_k=K, **okw):
    """The oracle in float64 on the layer's own (rounded) state and input."""
    p = {}
    params = dict(layer.named_parameters())
    for name, v in layer.state_dict().items():
        t = v.detach().to(torch.float64).clone()
        if name in params:
            t.requires_grad_(True)
        p[name] = t
    x64 = x.detach().to(torch.float64).clone().requires_grad_(True)
    res = oracle.oracle_forward(x64, p, **oracle_kwargs(opts, top_k), **okw)
    names = ["x"] + list(params)
    leaves = [x64] + [p[n] for n in params]
    gs = torch.autograd.grad((res.y * dy.to(torch.float64)).sum(), leaves, allow_unused=True)
    grads = {n: (g if g is not None else torch.zeros_like(l)) for n, g, l in zip(names, gs, leaves)}
    return res, grads


def assert_close(actual, expected, tol, what=""):
    """|actual - expected| <= tol * max|expected| elementwise (plus rtol tol).

    The absolute part is relative to the tensor's scale, so the tolerance is a
    statement about rounding of that precision, not about the values' size.
    """
    assert actual is not None, f"{what}: missing"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.detach().to(torch.float64)
    e = expected.detach().to(torch.float64)
    scale = e.abs().max().item() if e.numel() else 0.0
    torch.testing.assert_close(a, e, rtol=tol, atol=tol * max(scale, 1e-30), msg=lambda m: f"{what}: {m}")


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """One intra-op thread: the tensors here are tiny, and on a shared 2-core
    machine thread wake-ups cost milliseconds per op. Import this fixture into
    a test module to apply it there."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def routed_experts(layer, x, ids, w, dy, ep_group=None, config=None, backend="reference"):
    """MoKFunction alone on the layer's expert parameters (CPU, `backend`) for a given routing, under
    `config` (None: the default): y, d x, d topk-weights and d expert params (None where a bias is absent)."""
    from mok_nn import functional
    from mok_nn.autograd import MoKFunction

    ws = functional.get_workspace(hidden_size=layer.hidden_size, intermediate_size=layer.intermediate_size,
                                  num_experts=layer.num_experts, top_k=layer.top_k, ep_group=ep_group, device="cpu",
                                  dtype=x.dtype, backend=backend, activation=layer.activation,
                                  swiglu_limit=layer.swiglu_limit, config=config)
    e = layer.experts
    params = [p.detach().clone().requires_grad_(True) if p is not None else None
              for p in (e.gate_up_proj, e.down_proj, e.gate_up_proj_bias, e.down_proj_bias)]
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    y = MoKFunction.apply(x, w, *params, ids, ws)
    (y * dy).sum().backward()
    return {"y": y.detach(), "x": x.grad, "w": w.grad, "params": [p.grad if p is not None else None for p in params]}


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, tmpdir: str):
    """A worker process's gloo group over a file store in tmpdir, one thread, a 60 s timeout (a hang fails fast).
    After the body every rank meets at a barrier before the group goes: a rank closing its connections while a
    peer still receives makes gloo abort. mok_nn's workspaces, which hold the group, are released before it."""
    import torch.distributed as dist

    from mok_nn import functional

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmpdir}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
        dist.barrier()
    except BaseException:
        # spawn keeps a worker's traceback to itself, and the peer, left waiting, may abort first and be the
        # failure pytest shows: print it where the test's log has it
        traceback.print_exc()
        sys.stderr.flush()
        raise
    finally:
        functional.release_workspaces()
        dist.destroy_process_group()


def every_e4m3_byte_at_every_scale(programs_slow: bool, blocks_per_program: int = 64):
    """(data [rows, 256] float8_e4m3fn, scale [rows, 8] uint8): each row holds every E4M3 byte (8 blocks of 32),
    one E8M0 scale byte for its 8 blocks, every scale byte in some row: every byte under every scale. With
    programs of blocks_per_program blocks (8 rows each, triton_ops.DEQUANTIZE_FORM), programs_slow=False gives the
    rows in scale order (the programs inside triton_ops' fast scale range take it), True puts a NaN-scale row
    first in every program (each takes the general way)."""
    rows_per_program = blocks_per_program // 8
    scales = list(range(256))
    if programs_slow:
        per = rows_per_program - 1
        scales = [s for q in range(0, 256, per) for s in [255] + list(range(q, min(q + per, 256)))]
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    data = every.repeat(len(scales), 1).view(torch.float8_e4m3fn)
    scale = torch.tensor(scales, dtype=torch.int32).to(torch.uint8)[:, None].repeat(1, 8)
    return data, scale
