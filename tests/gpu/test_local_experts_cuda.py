"""The portable backend's local experts on the fused kernels (cuda_backend.local_mlp_forward / _backward) on the
GPU: bitwise the one-GPU path on the same rows (top_k = 1) with the real kernels, padding rows holding NaN, bf16
and MXFP8; and torch_backend with local_kernels within rounding of its own MLP, bitwise repeatable."""

import pytest
import torch

import layer_runs

from mok_nn import cuda_backend as cb
from mok_nn import torch_backend

local = layer_runs.load_cpu_test("test_cuda_local_experts")


@pytest.mark.parametrize("bias,precision", [(False, "bf16"), (True, "bf16"), (False, "mxfp8")])
def test_local_mlp_is_the_one_gpu_path_bit_for_bit(bias, precision):
    rows, ids, groups, weights, dy, w = (t.cuda() if isinstance(t, torch.Tensor) else t
                                         for t in local._grouped_rows(1, n_valid=700, n_pad=90, bias=bias))
    groups = torch_backend.groups_from_sorted_ids(torch.cat([ids, torch.full((90,), local.E, device="cuda")]),
                                                  local.E, fused=True, capacity=rows.shape[0], padded=True)
    weights = tuple(t.cuda() if t is not None else None for t in weights)
    n = ids.shape[0]
    args = (*weights, "swiglu", None)
    lr = cb.local_rows(groups.expert, groups.rank, groups.counts)
    out, gate_up = cb.local_mlp_forward(rows, lr, *args, precision=precision)
    g = cb.local_mlp_backward(rows, dy, w, gate_up, lr, *args, precision=precision)
    ids1 = ids.view(-1, 1)
    y, saved = cb.experts_forward(rows[:n].contiguous(), ids1, torch.ones(n, 1, device="cuda"), *args,
                                  precision=precision)
    dx, dtk, g1 = cb.experts_backward(dy[:n].contiguous(), saved, rows[:n].contiguous(), ids1,
                                      w[:n].view(-1, 1), *args, precision=precision)
    assert torch.equal(out[:n], y) and torch.isfinite(out[:n]).all()
    assert torch.equal(g.grad_rows[:n], dx) and torch.equal(g.grad_weights[:n], dtk.view(-1))
    for name in ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias"):
        a, b = getattr(g, name), getattr(g1, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
