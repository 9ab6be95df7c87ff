"""Macrobatches (MoKConfig.macrobatch_size) on the reference path: the tokens run in passes.

The oracle: separate one-pass calls on each pass's tokens. y, d x and d topk-weights equal their
concatenation bitwise and the parameter gradients their sum in pass order; both stay close to one
pass over all tokens (on CPU, BLAS rounds a row differently for other row counts; the CUDA kernels
give the one-pass bits for y, d x and d topk-weights, tests/gpu).
With expert parallelism (two gloo ranks) the same holds per rank, and token counts that differ
across the ranks are a clear error on every rank.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import (ACTIVATIONS, E, H, K, assert_close, gloo_rank, make_layer, random_x,  # noqa: F401
                     routed_experts, single_thread)
from mok_nn import MoKConfig, functional
from mok_nn.autograd import macrobatch_passes

I_MB = 16
OPTS = {"score_func": "softmax", "norm_topk_prob": True, **ACTIVATIONS["oai_limit"]}  # with expert biases


def _inputs(dtype, tokens, seed):
    layer = make_layer(OPTS, dtype=dtype, seed=seed, inter=I_MB)
    x = random_x((tokens, H), dtype, seed + 1)
    dy = random_x((tokens, H), dtype, seed + 2)
    g = torch.Generator().manual_seed(seed + 3)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    w = torch.rand(tokens, K, generator=g, dtype=torch.float64).to(dtype) + 0.1
    return layer, x, ids, w, dy


def _check_against_passes(layer, x, ids, w, dy, size, ep_group=None):
    """Macrobatched vs separate one-pass calls on each pass's tokens (bitwise) vs one pass (close)."""
    one = routed_experts(layer, x, ids, w, dy, ep_group, config=MoKConfig())
    cfg = MoKConfig(minibatch_size=1, macrobatch_size=size)
    got = routed_experts(layer, x, ids, w, dy, ep_group, config=cfg)
    # the oracle: one-pass calls on each pass's tokens; outputs concatenated, parameter gradients summed
    # in pass order (in their dtype)
    parts = [routed_experts(layer, x[s:s + size], ids[s:s + size], w[s:s + size], dy[s:s + size], ep_group,
                            config=MoKConfig())
             for s in range(0, x.shape[0], size)]
    tol = 2e-2 if x.dtype == torch.bfloat16 else 1e-5
    for name in ("y", "x", "w"):
        assert torch.equal(got[name], torch.cat([p[name] for p in parts])), f"{name}: not the passes' {name}"
        # (CPU BLAS rounds a row differently for other row counts: one pass is close, not equal; the
        # CUDA kernels give the one-pass bits, tests/gpu/test_cuda_layer.py)
        assert_close(got[name], one[name], tol, f"{name} vs one pass")
    total = parts[0]["params"]
    for p in parts[1:]:
        total = [t + g for t, g in zip(total, p["params"])]
    for i, (g, want, g_one) in enumerate(zip(got["params"], total, one["params"])):
        assert torch.equal(g, want), f"expert parameter {i}: not the per-pass sum"
        assert_close(g, g_one, tol, f"expert parameter {i} vs one pass")
    again = routed_experts(layer, x, ids, w, dy, ep_group, config=cfg)
    for name in ("y", "x", "w"):
        assert torch.equal(again[name], got[name]), f"{name} differs between two runs"
    assert all(torch.equal(a, b) for a, b in zip(again["params"], got["params"])), "gradients differ between runs"
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,size", [(23, 8), (24, 8), (9, 4)])
def test_macrobatch_equals_one_pass(dtype, tokens, size):
    layer, x, ids, w, dy = _inputs(dtype, tokens, seed=70 + tokens)
    _check_against_passes(layer, x, ids, w, dy, size)


def test_passes_cover_the_tokens_once():
    ws = functional.get_workspace(hidden_size=H, intermediate_size=I_MB, num_experts=E, top_k=K, device="cpu",
                                  config=MoKConfig(minibatch_size=4, macrobatch_size=10))
    assert macrobatch_passes(25, ws) == [(0, 10), (10, 20), (20, 25)]
    assert macrobatch_passes(10, ws) is None  # one pass: nothing to split
    assert macrobatch_passes(0, ws) is None
    assert macrobatch_passes(25, functional.get_workspace(hidden_size=H, intermediate_size=I_MB, num_experts=E,
                                                          top_k=K, device="cpu")) is None


def test_layer_with_macrobatches():
    """The layer (router, shared expert and all) under a macrobatch config: close to one pass."""
    from helpers import layer_forward_backward

    opts = {**OPTS, "shared_intermediate_size": 12}
    layer = make_layer(opts, dtype=torch.float32, seed=80, inter=I_MB)
    mb = make_layer(opts, dtype=torch.float32, seed=80, inter=I_MB, config=MoKConfig(minibatch_size=2,
                                                                                         macrobatch_size=5))
    x, dy = random_x((3, 6, H), torch.float32, 81), random_x((3, 6, H), torch.float32, 82)
    y, grads = layer_forward_backward(layer, x, dy)
    y_mb, grads_mb = layer_forward_backward(mb, x, dy)
    assert_close(y_mb, y, 1e-5, "y")
    for name, g in grads.items():
        assert_close(grads_mb[name], g, 1e-5, name)


# --------------------------------------------------------------------------
# two ranks (gloo)

def _worker(rank, world, tmpdir):
    with gloo_rank(rank, world, tmpdir):
        data = torch.load(os.path.join(tmpdir, "inputs.pt"))
        layer = make_layer(OPTS, dtype=torch.float32, seed=90, inter=I_MB)
        n = E // world
        e = layer.experts
        for p in (e.gate_up_proj, e.down_proj, e.gate_up_proj_bias, e.down_proj_bias):
            p.data = p.data[rank * n:(rank + 1) * n].clone()
        x, ids, w, dy = (data[k][rank] for k in ("x", "ids", "w", "dy"))
        out = {}
        try:
            _check_against_passes(layer, x, ids, w, dy, 4, dist.group.WORLD)
            out["equal_counts"] = "ok"
        except AssertionError as err:
            out["equal_counts"] = f"failed: {err}"
        cut = x.shape[0] - rank  # rank 1 one token short
        try:
            routed_experts(layer, x[:cut], ids[:cut], w[:cut], dy[:cut], dist.group.WORLD,
                           config=MoKConfig(minibatch_size=1, macrobatch_size=4))
            out["unequal_counts"] = None
        except ValueError as err:
            out["unequal_counts"] = str(err)
        # counts that differ but need no passes anywhere: one pass on every rank, the one-pass result
        one = routed_experts(layer, x[:cut], ids[:cut], w[:cut], dy[:cut], dist.group.WORLD, config=MoKConfig())
        big = routed_experts(layer, x[:cut], ids[:cut], w[:cut], dy[:cut], dist.group.WORLD,
                             config=MoKConfig(minibatch_size=1, macrobatch_size=64))
        out["unequal_one_pass"] = all(torch.equal(big[k], one[k]) for k in ("y", "x", "w")) and all(
            torch.equal(a, b) for a, b in zip(big["params"], one["params"]))
        torch.save(out, os.path.join(tmpdir, f"rank{rank}.pt"))


def test_macrobatch_with_expert_parallelism(tmp_path):
    world, tokens = 2, 10
    parts = [_inputs(torch.float32, tokens, seed=100 + r)[1:] for r in range(world)]
    data = {k: [p[i] for p in parts] for i, k in enumerate(("x", "ids", "w", "dy"))}
    torch.save(data, tmp_path / "inputs.pt")
    method = "spawn" if dist.is_initialized() else "fork"
    mp.start_processes(_worker, args=(world, str(tmp_path)), nprocs=world, join=True, start_method=method)
    for r in range(world):
        out = torch.load(tmp_path / f"rank{r}.pt")
        assert out["equal_counts"] == "ok", f"rank {r}: {out['equal_counts']}"
        assert out["unequal_counts"] is not None, f"rank {r}: token counts differing across ranks were accepted"
        assert "same number of tokens" in out["unequal_counts"] and "9 to 10" in out["unequal_counts"]
        assert out["unequal_one_pass"], f"rank {r}: differing counts without passes must run as one pass"
