"""The CUDA paths' gradient accumulation over macrobatch passes (`grads_into`), on the CPU.

cuda_backend.experts_backward (EP = 1) and cuda_ep.backward (EP = 2, two threads over simulated
symmetric buffers, tests/test_cuda_ep_simulated.py) run with their torch stand-ins: each pass's
backward adds its weight and bias gradients into the first pass's (the CPU fallback of
weight_grad(into=), the path the accumulating kernel replaces on the GPU). The oracle: the same
passes without accumulation, their gradients summed in pass order; y, d x and d topk-weights must
not change. With and without expert biases.
"""

import pytest
import torch

from mok_nn import cuda_backend as cb
from mok_nn import cuda_ep
from mok_nn.functional import ExpertParams
from test_cuda_ep_simulated import _problem, _rank_workspace, _run_ranks, _shared_buffers, patch_cpu_kernels

H, I, E, K = 32, 16, 8, 2
T, SIZE = 13, 5
PASSES = [(s, min(s + SIZE, T)) for s in range(0, T, SIZE)]


def _names(bias):
    return ["gate_up_proj", "down_proj"] + (["gate_up_bias", "down_bias"] if bias else [])


def _check(accumulated, separate, bias):
    """accumulated / separate: per pass (dx, d topk-weights, GroupedMLPGrads)."""
    for (dx, dw, _), (dx2, dw2, _) in zip(accumulated, separate):
        assert torch.equal(dx, dx2) and torch.equal(dw, dw2), "the row gradients changed"
    final = accumulated[-1][2]
    for name in _names(bias):
        want = getattr(separate[0][2], name)
        for part in separate[1:]:
            want = want + getattr(part[2], name)
        assert torch.equal(getattr(final, name), want), name


@pytest.mark.parametrize("bias", [False, True])
def test_single_gpu_path_adds_the_passes(monkeypatch, bias):
    patch_cpu_kernels(monkeypatch)
    monkeypatch.setenv("MOK_SCHEDULE", "torch")
    g = torch.Generator().manual_seed(1)
    W13, W2, b13, b2, xs, dys, ids, ws_ = _problem(g, [T], H, I, E, K, bias, 0.1)
    x, dy, ids, w = xs[0], dys[0], ids[0], ws_[0]

    def run(accumulate):
        saved = [cb.experts_forward(x[s:t], ids[s:t], w[s:t], W13, W2, b13, b2, "swiglu", None)[1]
                 for s, t in PASSES]
        grads, outs = None, []
        for (s, t), sv in zip(PASSES, saved):
            dx, dw, grads_pass = cb.experts_backward(dy[s:t], sv, x[s:t], ids[s:t], w[s:t], W13, W2, b13, b2,
                                                     "swiglu", None, grads if accumulate else None)
            outs.append((dx, dw, grads_pass))
            grads = grads_pass
        return outs

    _check(run(True), run(False), bias)


@pytest.mark.parametrize("bias", [False, True])
def test_ep_path_adds_the_passes(monkeypatch, bias):
    patch_cpu_kernels(monkeypatch)
    monkeypatch.setenv("MOK_EP_COPY", "torch")
    P = 2
    g = torch.Generator().manual_seed(3)
    W13, W2, b13, b2, xs, dys, ids, ws_ = _problem(g, [T, T], H, I, E, K, bias, 0.1)
    e_l = E // P

    def run(accumulate):
        raws, barrier = _shared_buffers(P, SIZE, H, K)

        def rank_fn(r):
            sl = slice(r * e_l, (r + 1) * e_l)
            params = ExpertParams(W13[sl], W2[sl], None if b13 is None else b13[sl], None if b2 is None else b2[sl])
            ws = _rank_workspace(raws, r, SIZE, E, H, K, barrier)
            saved = [cuda_ep.forward(xs[r][s:t], ids[r][s:t], ws_[r][s:t], params, None, ws)[1] for s, t in PASSES]
            grads, outs = None, []
            for (s, t), sv in zip(PASSES, saved):
                dx, dw, grads_pass = cuda_ep.backward(dys[r][s:t], sv, xs[r][s:t], ids[r][s:t], ws_[r][s:t], params,
                                                      ws, grads if accumulate else None)
                outs.append((dx, dw, grads_pass))
                grads = grads_pass
            assert all(int(f.sum()) == 0 for f in ws.ep_state["seen"]), "a pass was flagged"
            return outs

        return _run_ranks(rank_fn, P)

    for got, want in zip(run(True), run(False)):
        _check(got, want, bias)
