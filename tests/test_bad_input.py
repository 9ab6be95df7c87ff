"""Bad input gets a clear exception whose message names the problem; empty
input (T = 0) is not bad input and returns an empty output."""

import pytest
import torch

from helpers import ACTIVATIONS, H, ROUTINGS, make_layer, random_x, single_thread  # noqa: F401

OPTS = {**ROUTINGS["softmax_norm"], **ACTIVATIONS["swiglu"]}


def _layer(dtype=torch.float32, **kw):
    return make_layer({**OPTS, **kw}, dtype=dtype, seed=0)


# --- forward input


def test_wrong_hidden_size():
    layer = _layer()
    with pytest.raises(ValueError, match=r"(?i)hidden"):
        layer(random_x((4, H + 1), torch.float32, 0))


def test_wrong_dtype():
    layer = _layer(torch.bfloat16)
    with pytest.raises((TypeError, ValueError), match=r"(?i)dtype"):
        layer(random_x((4, H), torch.float32, 0))
    with pytest.raises((TypeError, ValueError), match=r"(?i)dtype"):
        layer(torch.ones(4, H, dtype=torch.int64))


def test_wrong_device():
    layer = _layer()
    with pytest.raises((RuntimeError, ValueError), match=r"(?i)device"):
        layer(torch.empty(4, H, device="meta"))


def test_not_a_tensor_or_0d():
    layer = _layer()
    with pytest.raises((TypeError, ValueError)):
        layer(torch.tensor(1.0))


def test_non_contiguous_input():
    """Either a clear error naming contiguity, or the same result as the
    contiguous copy, bit for bit (outputs and the input gradient)."""
    layer = _layer()
    base = random_x((H, 7), torch.float32, 1)
    x = base.t()  # [7, H], strides (1, 7)
    assert not x.is_contiguous()
    try:
        y = layer(x.requires_grad_(False))
    except (ValueError, RuntimeError) as err:
        assert "contiguous" in str(err).lower(), f"unclear error for non-contiguous input: {err}"
        return
    xc = x.contiguous()
    assert torch.equal(y, layer(xc))
    # Gradients too.
    x1 = base.clone().requires_grad_(True)
    layer(x1.t()).square().sum().backward()
    x2 = xc.clone().requires_grad_(True)
    layer(x2).square().sum().backward()
    assert torch.equal(x1.grad.t(), x2.grad)


@pytest.mark.parametrize("shape", [(0, H), (2, 0, H)])
def test_empty_input(shape):
    """T = 0 tokens: empty output of the same shape; backward works and gives
    empty / zero gradients."""
    layer = _layer(shared_intermediate_size=8, shared_expert_gate=True, expert_proj_bias=True,
                   aux_loss_coef=0.01, z_loss_coef=1e-3)
    x = torch.zeros(shape, dtype=torch.float32, requires_grad=True)
    y = layer(x)
    assert y.shape == shape and y.dtype == torch.float32
    assert layer.router_logits.shape[0] == 0
    # A rank without tokens must not poison the loss with NaN.
    assert torch.isfinite(layer.aux_loss)
    (y.sum() + layer.aux_loss).backward()
    assert x.grad is not None and x.grad.shape == shape
    for name, p in layer.named_parameters():
        assert p.grad is None or (p.grad == 0).all(), name


# --- constructor arguments


def test_top_k_greater_than_num_experts():
    with pytest.raises(ValueError, match=r"(?i)top_k"):
        make_layer(OPTS, experts=4, top_k=5)


@pytest.mark.parametrize("kw,word", [
    (dict(top_k=0), "top_k"),
    (dict(hidden=0), "hidden_size"),
    (dict(inter=0), "intermediate_size"),
    (dict(experts=0), "num_experts"),
])
def test_nonpositive_sizes(kw, word):
    with pytest.raises(ValueError, match=rf"(?i){word}"):
        make_layer(OPTS, **kw)


@pytest.mark.parametrize("kw,word", [
    (dict(score_func="relu"), "score_func"),
    (dict(activation="gelu"), "activation"),
    (dict(n_group=3, topk_group=1), "n_group"),        # 16 experts not divisible by 3 groups
    (dict(n_group=4, topk_group=5), "topk_group"),     # more groups kept than exist
    (dict(n_group=4), "topk_group"),                   # n_group without topk_group
    (dict(swiglu_limit=-1.0), "swiglu_limit"),
    (dict(precision="fp4"), "precision"),
    (dict(backend="tpu"), "backend"),
])
def test_bad_options(kw, word):
    with pytest.raises(ValueError, match=rf"(?i){word}"):
        make_layer({**OPTS, **kw})


def test_groups_hold_fewer_experts_than_top_k():
    # 16 experts in 4 groups, 1 group kept: 4 candidates for top_k = 5.
    with pytest.raises(ValueError, match=r"(?i)top_?k"):
        make_layer({**OPTS, "n_group": 4, "topk_group": 1}, top_k=5)


def test_cuda_backend_without_cuda():
    """backend="cuda" where CUDA is absent raises (at construction or on the
    first call), never falls back silently."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    from mok_nn import MoKMoELayer

    with pytest.raises((RuntimeError, ValueError), match=r"(?i)cuda"):
        layer = MoKMoELayer(hidden_size=H, intermediate_size=8, num_experts=4, top_k=2, backend="cuda",
                            dtype=torch.bfloat16)
        layer(random_x((3, H), torch.bfloat16, 0))


# --- MoKConfig


@pytest.mark.parametrize("field,value", [
    ("fwd_num_comm_sms", -1),
    ("bwd_num_comm_sms", -1),
    ("minibatch_size", 0),
    ("macrobatch_size", 0),
    ("schedule_capacity_multiplier", 0.0),
    ("schedule_capacity_multiplier", float("nan")),
    ("minibatch_size", 2.5),
])
def test_bad_config(field, value):
    from mok_nn import MoKConfig

    with pytest.raises((ValueError, TypeError), match=field):
        MoKConfig(**{field: value})


def test_default_config_is_valid():
    from mok_nn import MoKConfig

    MoKConfig()


def test_macrobatch_below_the_default_minibatch_is_accepted():
    """minibatch_size is not read anywhere (MoKConfig docstring), so it does not bound macrobatch_size:
    MoKConfig(macrobatch_size=4) with the default minibatch_size runs passes of 4 tokens exactly as with
    minibatch_size=1 (bitwise), close to the float64 oracle."""
    from helpers import assert_close, layer_forward_backward, oracle_forward_backward
    from mok_nn import MoKConfig

    assert MoKConfig(macrobatch_size=512).minibatch_size == 1024
    cfg = MoKConfig(macrobatch_size=4)
    layer = _layer(torch.float64, config=cfg)
    ref = _layer(torch.float64, config=MoKConfig(minibatch_size=1, macrobatch_size=4))
    x, dy = random_x((11, H), torch.float64, 3), random_x((11, H), torch.float64, 4)
    y, grads = layer_forward_backward(layer, x, dy)
    y_ref, grads_ref = layer_forward_backward(ref, x, dy)
    assert torch.equal(y, y_ref) and grads.keys() == grads_ref.keys()
    assert all(torch.equal(grads[k], grads_ref[k]) for k in grads)
    res, grads_or = oracle_forward_backward(layer, OPTS, x, dy)
    assert_close(y, res.y, 1e-12, "y")
    for k in grads:
        assert_close(grads[k], grads_or[k], 1e-12, k)


@pytest.mark.parametrize("field,value", [("fwd_num_comm_sms", 8), ("bwd_num_comm_sms", 0), ("minibatch_size", 512)])
def test_reserved_knobs_say_they_change_nothing(field, value):
    """The reserved knobs are validated and kept, but no kernel reads them: setting one is not silent."""
    import warnings

    from mok_nn import MoKConfig

    with pytest.warns(UserWarning, match=f"MoKConfig.{field} is reserved"):
        assert getattr(MoKConfig(**{field: value}), field) == value
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MoKConfig(macrobatch_size=64, schedule_capacity_multiplier=3.0)  # the knobs that act: no warning


@pytest.mark.parametrize("field", ["fwd_num_comm_sms", "bwd_num_comm_sms"])
def test_zero_comm_sms_only_without_expert_parallelism(field, monkeypatch):
    """MoKConfig: 0 communication SMs is allowed only without expert parallelism."""
    import mok_nn.layer
    from mok_nn import MoKConfig, MoKMoELayer

    kw = dict(hidden_size=H, intermediate_size=8, num_experts=4, top_k=2, backend="reference", dtype=torch.float32)
    MoKMoELayer(**kw, config=MoKConfig(**{field: 0}))  # EP = 1: fine
    # a stand-in group of size 2 (only its size and this rank are read at construction)
    monkeypatch.setattr(mok_nn.layer, "group_size_and_rank", lambda g: (1, 0) if g is None else (2, 0))
    MoKMoELayer(**kw, ep_group=object())
    with pytest.raises(ValueError, match=field):
        MoKMoELayer(**kw, ep_group=object(), config=MoKConfig(**{field: 0}))


def test_config_takes_numpy_numbers_as_plain_ones():
    """MoKConfig takes numpy integers and floats as the Python numbers they are (equal, same hash: the config is a
    workspace cache key), and rejects an infinite capacity multiplier and non-integral sizes."""
    import numpy as np

    from mok_nn import MoKConfig

    a = MoKConfig(macrobatch_size=np.int64(4), minibatch_size=np.int32(8), schedule_capacity_multiplier=np.float32(3))
    b = MoKConfig(macrobatch_size=4, minibatch_size=8, schedule_capacity_multiplier=3.0)
    assert a == b and hash(a) == hash(b) and type(a.macrobatch_size) is int and type(a.minibatch_size) is int
    for kw, exc in ((dict(schedule_capacity_multiplier=float("inf")), ValueError), (dict(macrobatch_size=1.5), TypeError),
                    (dict(minibatch_size=True), TypeError), (dict(schedule_capacity_multiplier="2"), TypeError)):
        with pytest.raises(exc, match="MoKConfig"):
            MoKConfig(**kw)


def test_debug_switches_reject_unknown_values(monkeypatch):
    """The debugging oracles read per call (MOK_GEMM, MOK_ACT) raise naming the variable for a value they do not
    know, instead of silently meaning their default."""
    from mok_nn import cuda_backend as cb

    for var, fn, bad in (("MOK_GEMM", cb._use_torch_gemm, "yes"), ("MOK_ACT", cb._use_torch_act, "1")):
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=var):
            fn()
        monkeypatch.setenv(var, "torch")
        assert fn() is True
        monkeypatch.delenv(var)
        assert fn() is False
