"""The portable backend's local experts on the fused one-GPU kernels (expert parallelism the EP kernels cannot take,
e.g. across hosts): cuda_local.local_rows / local_mlp_forward / local_mlp_backward, on the CPU with
test_cuda_wiring's stand-in kernel library. Oracle: the one-GPU path (experts_forward / experts_backward) on the
same rows routed to their experts with top_k = 1, which runs the same kernels: bitwise equal on every routed row
and every gradient, whatever the padding rows of the bounded exchange hold; and torch_backend's own MLP within
rounding, with the layer's choice of where the local experts run."""

import pytest
import torch

from mok_nn import cuda_backend as cb
from mok_nn import cuda_local
from mok_nn import torch_backend

from test_cuda_wiring import fake_lib, random_problem  # noqa: F401

H, I, E = 64, 32, 4


def grouped_rows(seed, n_valid=45, n_pad=11, bias=False, device="cpu"):
    """Rows sorted by expert (each expert's rows in order) and n_pad padding rows at the end (NaN), as the bounded
    exchange leaves them; their Groups (ids past the last expert: padding); weights, d y and w: bf16 / fp32."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (n_valid,), generator=g)
    ids = torch.sort(torch.where(ids == 1, 0, ids)).values  # expert 1 gets no row; the padding rows follow E - 1's
    rows = torch.cat([torch.randn(n_valid, H, generator=g), torch.full((n_pad, H), float("nan"))]).bfloat16()
    W13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).bfloat16()
    W2 = (torch.randn(E, H, I, generator=g) / I**0.5).bfloat16()
    b13 = (torch.randn(E, 2 * I, generator=g) * 0.1).bfloat16() if bias else None
    b2 = (torch.randn(E, H, generator=g) * 0.1).bfloat16() if bias else None
    dy = torch.randn(rows.shape[0], H, generator=g).bfloat16()
    w = torch.rand(rows.shape[0], generator=g)
    rows, ids, dy, w = (t.to(device) for t in (rows, ids, dy, w))
    weights = tuple(None if t is None else t.to(device) for t in (W13, W2, b13, b2))
    sorted_ids = torch.cat([ids, torch.full((n_pad,), E, device=device)])
    groups = torch_backend.groups_from_sorted_ids(sorted_ids, E, fused=False, capacity=rows.shape[0], padded=True)
    return rows, ids, groups, weights, dy, w


def test_local_rows_schedule():
    """Each expert's routed rows fill the start of its segment (padded to TILE_M) in their order; padding rows
    get no schedule row; the tiles past the segments (one at least) belong to no expert."""
    rows, ids, groups, *_ = grouped_rows(0)
    lr = cuda_local.local_rows(groups.expert, groups.rank, groups.counts)
    n = ids.shape[0]
    assert lr.valid.tolist() == [True] * n + [False] * (rows.shape[0] - n)
    start = 0
    for e in range(E):
        c = int((ids == e).sum())
        assert int(lr.sched.seg_rows[e]) == c and int(lr.sched.seg_end[e]) == start + -(-c // 128) * 128
        mine = (ids == e).nonzero().flatten()
        assert lr.dst[mine].tolist() == list(range(start, start + c))
        assert lr.src[start:start + c].tolist() == mine.tolist()
        start = int(lr.sched.seg_end[e])
    assert (lr.src[lr.src < rows.shape[0]].sort().values == torch.arange(n)).all()  # each routed row once
    assert lr.scatter_to.unique().numel() == rows.shape[0]  # scatters repeat no index (deterministic on a GPU)
    w = torch.rand(rows.shape[0])
    assert torch.equal(lr.scatter(w, 0.0)[lr.dst[:n]], w[:n]) and lr.scatter(w, 0.0).shape == (lr.sched.capacity,)
    assert (lr.sched.tile_expert[start // 128:] == -1).all() and lr.sched.capacity > start


def check_local_is_the_one_gpu_path(rows, ids, groups, weights, dy, w, precision):
    """local_mlp_forward / _backward against experts_forward / _backward on the routed rows (each routed to its
    expert with weight 1 in the forward, w in the backward), bitwise; frozen weights: no weight gradients."""
    n = ids.shape[0]
    args = (*weights, "swiglu", None)
    lr = cuda_local.local_rows(groups.expert, groups.rank, groups.counts)
    out, gate_up = cuda_local.local_mlp_forward(rows, lr, *args, precision=precision)
    g = cuda_local.local_mlp_backward(rows, dy, w, gate_up, lr, *args, precision=precision)
    ids1 = ids.view(-1, 1)
    y, saved = cb.experts_forward(rows[:n], ids1, torch.ones(n, 1, device=rows.device), *args, precision=precision)
    dx, dtk, g1 = cb.experts_backward(dy[:n], saved, rows[:n], ids1, w[:n].view(-1, 1), *args, precision=precision)
    assert torch.equal(out[:n], y) and torch.isfinite(out[:n]).all()
    assert torch.equal(g.grad_rows[:n], dx) and torch.equal(g.grad_weights[:n], dtk.view(-1))
    for name in ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias"):
        a, b = getattr(g, name), getattr(g1, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
    frozen = cuda_local.local_mlp_backward(rows, dy, w, gate_up, lr, *args, precision=precision,
                                   needs=(False, False, True, True))
    assert frozen.gate_up_proj is None and frozen.down_proj is None
    assert torch.equal(frozen.grad_rows[:n], dx)


@pytest.mark.parametrize("bias,precision", [(False, "bf16"), (True, "bf16"), (False, "mxfp8")])
def test_local_mlp_is_the_one_gpu_path_bit_for_bit(fake_lib, bias, precision):
    rows, ids, groups, weights, dy, w = grouped_rows(1, bias=bias)
    check_local_is_the_one_gpu_path(rows, ids, groups, weights, dy, w, precision)


def test_torch_backend_with_local_kernels(fake_lib):
    """torch_backend.experts_forward / backward with local_kernels: the same function as its own MLP (within the
    bf16 roundings the two paths store differently), bitwise repeatable."""
    x, ids, w, dy, W13, W2, _, _ = random_problem(37, H, I, E, 2, False, seed=2)
    args = (W13, W2, None, None, "swiglu", None)

    def run(local):
        y, saved = torch_backend.experts_forward(x, ids, w, *args, local_kernels=local)
        dx, dtk, gr = torch_backend.experts_backward(dy, saved, x, ids, w, *args)
        return [y, dx, dtk, gr.gate_up_proj, gr.down_proj], saved

    (got, saved), (again, _), (want, _) = run(True), run(True), run(False)
    assert saved.local is not None
    for a, b, c in zip(got, again, want):
        assert torch.equal(a, b)
        assert ((a.float() - c.float()).norm() / c.float().norm()).item() < 2e-2


def test_layer_runs_local_experts_on_the_kernels_where_only_the_ep_group_is_refused(monkeypatch):
    """backend="auto" with an EP group the EP kernels refuse (across hosts): the portable backend, with its local
    experts on the fused kernels where the one-GPU path takes the layer; "torch" where it does not, or where the
    user asked for backend="torch"."""
    from mok_nn import MoKMoELayer

    layer = MoKMoELayer(H, I, E, 2)
    layer.ep_size = 2  # (a group is never formed: the choice alone is asked)
    x = torch.empty(3, H, dtype=torch.bfloat16, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(cb, "unsupported_reason", lambda layer, x: None)
    assert layer._local_experts(x, "torch") == "cuda"
    assert layer._local_experts(x, "cuda") == "torch"  # (the fused path itself: no local choice)
    monkeypatch.setattr(cb, "unsupported_reason", lambda layer, x: "kernels are built for sm_90a")
    assert layer._local_experts(x, "torch") == "torch"
    monkeypatch.setattr(cb, "unsupported_reason", lambda layer, x: None)
    layer.backend = "torch"
    assert layer._local_experts(x, "torch") == "torch"
    layer.backend, layer.ep_size = "auto", 1
    assert layer._local_experts(x, "torch") == "torch"


def test_workspace_refuses_local_kernels_off_the_portable_backend():
    from mok_nn import functional

    with pytest.raises(ValueError, match="local_experts"):
        functional.get_workspace(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2, backend="reference",
                                 local_experts="cuda")
    with pytest.raises(ValueError, match="local_experts"):
        functional.get_workspace(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2, backend="torch",
                                 local_experts="triton")
