"""The portable backend's bounded expert-parallel exchange (MoKConfig.schedule_capacity_multiplier set): fixed
blocks of C rows per peer, the counts sent as data, nothing read on the host. P ranks (gloo, one process each):

- given the same routing, y, d x, d topk-weights and the local expert gradients are bitwise those of one process
  and of the host-split path (schedule_capacity_multiplier=None), at P = 2 and 4, fp32 and bf16, with uneven
  token counts (a rank of one token);
- a forward + backward records no aten op that reads device values on the host (the host-split path does);
- a skewed routing that overflows the exchange (multiplier 1.5): every output and gradient NaN on every rank,
  and EPError, naming the counts and the knob, from the next call and from functional.check_errors."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import E, H, K, gloo_rank, make_layer, random_x, routed_experts, single_thread  # noqa: F401
from test_expert_parallel import I_EP, OPTS
from test_torch_backend import SYNC_OPS, _RecordOps

F32, BF16 = torch.float32, torch.bfloat16
CASES = {"ep2_fp32": ([9, 14], F32), "ep2_bf16": ([9, 14], BF16), "ep4_fp32": ([9, 1, 13, 6], F32),
         "ep4_bf16": ([9, 1, 13, 6], BF16)}


def _layer_on_rank(data, rank, world):
    from mok_nn import MoKMoELayer

    layer = MoKMoELayer(hidden_size=H, intermediate_size=I_EP, num_experts=E, top_k=K, backend="torch",
                        device="cpu", dtype=data["dtype"], ep_group=dist.group.WORLD, **OPTS)
    n = E // world
    layer.load_state_dict({k: (v[rank * n:(rank + 1) * n] if k.startswith("experts.") else v)
                           for k, v in data["state"].items()})
    return layer


def _run_function(layer, x, ids, w, dy, config):
    """MoKFunction on the torch backend under config, its aten ops recorded: (y, d x, d w, param grads, ops, ws)."""
    from mok_nn import functional
    from mok_nn.autograd import MoKFunction

    ws = functional.get_workspace(hidden_size=H, intermediate_size=I_EP, num_experts=E, top_k=K,
                                  ep_group=dist.group.WORLD, device="cpu", dtype=x.dtype, backend="torch",
                                  activation=layer.activation, swiglu_limit=layer.swiglu_limit, config=config)
    e = layer.experts
    params = [p.detach().clone().requires_grad_(True) if p is not None else None
              for p in (e.gate_up_proj, e.down_proj, e.gate_up_proj_bias, e.down_proj_bias)]
    xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with _RecordOps() as rec:
        y = MoKFunction.apply(xx, ww, *params, ids, ws)
        (y * dy).sum().backward()
    return y.detach(), xx.grad, ww.grad, [p.grad for p in params if p is not None], set(rec.ops), ws


def _worker(rank, world, tmpdir):
    with gloo_rank(rank, world, tmpdir):
        from mok_nn import MoKConfig, functional
        from mok_nn.distributed import EPError
        from mok_nn.torch_ep import BoundedPlan

        data = torch.load(os.path.join(tmpdir, "inputs.pt"))
        x, dy, ids, w = (data[name][rank] for name in ("x", "dy", "ids", "w"))
        layer = _layer_on_rank(data, rank, world)
        bounded, exact = MoKConfig(schedule_capacity_multiplier=2.0), MoKConfig(schedule_capacity_multiplier=None)
        out = {"bounded": routed_experts(layer, x, ids, w, dy, dist.group.WORLD, bounded, "torch"),
               "exact": routed_experts(layer, x, ids, w, dy, dist.group.WORLD, exact, "torch")}
        # the second call on the workspace (the first one agreed the token capacity): recorded
        *res, ops, ws = _run_function(layer, x, ids, w, dy, bounded)
        out["recorded"], out["ops"] = res, ops
        out["capacity"] = ws.ep_state["capacity"]
        out["plan_is_bounded"] = isinstance(
            functional.build_schedule(ids, ws).plan, BoundedPlan)
        out["exact_ops"] = _run_function(layer, x, ids, w, dy, exact)[4]

        # overflow: every slot of every rank routed to rank 0's experts, multiplier 1.5 (the true routing fits)
        tight = MoKConfig(schedule_capacity_multiplier=1.5)
        skew = torch.arange(K).expand(ids.shape[0], K).contiguous()
        y, dx, dw, pgrads, _, ws = _run_function(layer, x, skew, w, dy, tight)
        out["overflow_all_nan"] = all(bool(t.isnan().all()) for t in (y, dx, dw, *pgrads))
        try:
            functional.check_errors(ws)
            out["check_error"] = None
        except EPError as err:
            out["check_error"] = str(err)
        _run_function(layer, x, skew, w, dy, tight)  # flagged again; the next call raises it
        try:
            _run_function(layer, x, ids, w, dy, tight)
            out["next_call_error"] = None
        except EPError as err:
            out["next_call_error"] = str(err)
        # after the error the workspace works again (the call that raised sent nothing: the ranks stay in step)
        out["after"] = _run_function(layer, x, ids, w, dy, tight)[:4]
        functional.check_errors(ws)
        torch.save(out, os.path.join(tmpdir, f"rank{rank}.pt"))


@pytest.fixture(scope="module", params=list(CASES))
def run(request, tmp_path_factory):
    counts, dtype = CASES[request.param]
    world = len(counts)
    tmpdir = str(tmp_path_factory.mktemp(request.param))
    from mok_nn.router import route

    layer = make_layer(OPTS, dtype=dtype, seed=60, inter=I_EP, backend="torch")
    T = sum(counts)
    x, dy = random_x((T, H), dtype, 61), random_x((T, H), dtype, 62)
    ids, w = route(layer.router(x).detach().float(), K, OPTS["score_func"], OPTS["norm_topk_prob"], OPTS["n_group"],
                   OPTS["topk_group"], OPTS["routed_scaling_factor"], layer.router.e_score_correction_bias)[:2]
    w = w.to(dtype)
    single = routed_experts(layer, x, ids, w, dy, backend="torch")
    torch.save({"state": layer.state_dict(), "x": list(x.split(counts)), "dy": list(dy.split(counts)),
                "ids": list(ids.split(counts)), "w": list(w.split(counts)), "dtype": dtype},
               os.path.join(tmpdir, "inputs.pt"))
    method = "spawn" if dist.is_initialized() else "fork"
    mp.start_processes(_worker, args=(world, tmpdir), nprocs=world, join=True, start_method=method)
    return counts, single, [torch.load(os.path.join(tmpdir, f"rank{r}.pt")) for r in range(world)]


def _per_rank(counts, single, r):
    n = E // len(counts)
    start = sum(counts[:r])
    sl = slice(start, start + counts[r])
    return ([single["y"][sl], single["x"][sl], single["w"][sl]],
            [g[r * n:(r + 1) * n] for g in single["params"] if g is not None])


def test_bitwise_one_process_and_host_split(run):
    counts, single, ranks = run
    for r, out in enumerate(ranks):
        assert out["plan_is_bounded"]
        want, want_params = _per_rank(counts, single, r)
        for label in ("bounded", "exact"):
            got = out[label]
            for name, g, ref in zip(("y", "dx", "dw"), (got["y"], got["x"], got["w"]), want):
                assert torch.equal(g, ref), f"rank {r} {label} {name}"
            for i, (g, ref) in enumerate(zip([p for p in got["params"] if p is not None], want_params)):
                assert torch.equal(g, ref), f"rank {r} {label} param {i}"
        rec = out["recorded"]
        for name, g, ref in zip(("y", "dx", "dw"), rec[:3], want):
            assert torch.equal(g, ref), f"rank {r} recorded {name}"
        for g, ref in zip(rec[3], want_params):
            assert torch.equal(g, ref), f"rank {r} recorded param"
        for g, ref in zip(out["after"][:3], want):
            assert torch.equal(g, ref), f"rank {r} after the overflow error"


def test_no_host_read(run):
    _, _, ranks = run
    for r, out in enumerate(ranks):
        assert "c10d.alltoall_base_" in out["ops"] or any("alltoall" in op for op in out["ops"]), out["ops"]
        assert not out["ops"] & SYNC_OPS, (r, out["ops"] & SYNC_OPS)
        assert out["exact_ops"] & SYNC_OPS, "the recorder does not see the host-split path's host reads"


def test_capacity_rule(run):
    counts, _, ranks = run
    world = len(counts)
    tc = max(counts)
    for out in ranks:
        assert out["capacity"] == min(-(-2 * tc * K // world), tc * min(K, E // world))


def test_overflow_is_nan_and_raised(run):
    _, _, ranks = run
    for r, out in enumerate(ranks):
        assert out["overflow_all_nan"], f"rank {r}: an overflowing call left finite outputs"
        for key in ("check_error", "next_call_error"):
            msg = out[key]
            assert msg is not None, f"rank {r}: {key} raised nothing"
            assert "schedule_capacity_multiplier" in msg and "rows to one peer" in msg, msg


def test_no_bound_option_and_the_cuda_meaning():
    """schedule_capacity_multiplier=None is accepted (no bound: the host-split exchange here, the worst case on the
    CUDA path); the portable per-pair capacity is the CUDA path's m x Tc*k split over P pairs, capped at the
    worst case."""
    from mok_nn import MoKConfig
    from mok_nn.cuda_ep import TILE_M, schedule_capacity
    from mok_nn.torch_ep import exchange_capacity

    assert MoKConfig(schedule_capacity_multiplier=None).schedule_capacity_multiplier is None
    worst = schedule_capacity(100, 8, 4, 8, None)
    assert worst == schedule_capacity(100, 8, 4, 8, 8.0) == -(-(8 * 100 * 8 + 4 * (TILE_M - 1)) // TILE_M) * TILE_M
    assert exchange_capacity(100, 8, 32, 8, 2.0) == 200  # ceil(2 * 100 * 8 / 8)
    assert exchange_capacity(100, 8, 4, 8, 2.0) == 200  # the worst pair: 100 tokens x min(8, 4) experts
    assert exchange_capacity(100, 8, 2, 8, 2.0) == 200 and exchange_capacity(100, 8, 1, 8, 2.0) == 100
    assert exchange_capacity(7, 3, 5, 4, 1.0) == 6  # ceil(21 / 4)
