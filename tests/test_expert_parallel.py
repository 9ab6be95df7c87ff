"""Expert parallelism on the reference path and on the portable backend (backend="torch"): P ranks (gloo, one
process each) hold experts [r*E/P, (r+1)*E/P) and their own tokens; outputs and gradients equal the
single-process layer (same backend) on the concatenated batch, and the routed experts are bitwise those of
one process for the same routing."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import (ACTIVATIONS, E, H, K, ROUTINGS, assert_close, gloo_rank, layer_forward_backward, make_layer,
                     random_x, routed_experts, single_thread)  # noqa: F401

I_EP = 16

# Everything that touches expert sharding at once: group-limited biased
# routing with a router bias, expert projection biases, clamped GPT-OSS
# activation, gated shared expert.
OPTS = {**ROUTINGS["sigmoid_group_bias"], **ACTIVATIONS["oai_limit"], "shared_intermediate_size": 12,
        "shared_expert_gate": True, "router_bias": True}

# (tokens per rank, dtype): uneven on purpose, with a rank of one token and a
# rank without tokens; bf16 rows travel the all-to-all as 16-bit words.
F32, BF16 = torch.float32, torch.bfloat16
CASES = {
    "ep2": ([9, 14], F32),
    "ep4": ([9, 1, 13, 6], F32),
    "ep2_empty_rank": ([11, 0], F32),
    "ep2_bf16": ([9, 14], BF16),
}

# EP changes only the order in which tokens meet in an expert's buffer (expert
# weight gradients), splits router / shared-expert gradients into per-rank
# partial sums, and runs the dense router / shared-expert GEMMs over fewer
# rows (CPU BLAS rounds differently for different row counts). All of it is
# rounding: fp32, a few ulps (2^-23) over at most ~40 summands, far below 1e-5
# of each tensor's largest magnitude; bf16 parameter gradients are stored in
# bf16 (2^-8 ~ 4e-3) on each rank before the test sums them: a few bf16 ulps.
TOL = {F32: 1e-5, BF16: 2e-2}


def _worker(rank, world, tmpdir):
    with gloo_rank(rank, world, tmpdir):
        from mok_nn import MoKMoELayer

        data = torch.load(os.path.join(tmpdir, "inputs.pt"))
        full, x, dy = data["state"], data["x"][rank], data["dy"][rank]
        backend = data["backend"]
        layer = MoKMoELayer(hidden_size=H, intermediate_size=I_EP, num_experts=E, top_k=K, backend=backend,
                            device="cpu", dtype=data["dtype"], ep_group=dist.group.WORLD, **OPTS)
        n = E // world
        shard = {k: (v[rank * n:(rank + 1) * n] if k.startswith("experts.") else v) for k, v in full.items()}
        layer.load_state_dict(shard)
        y, grads = layer_forward_backward(layer, x, dy)
        out = {"y": y, "grads": grads, "logits": layer.router_logits.detach(),
               "shapes": {k: tuple(v.shape) for k, v in layer.state_dict().items()},
               "routed": routed_experts(layer, x, data["ids"][rank], data["w"][rank], dy, dist.group.WORLD,
                                        backend=backend)}

        # Experts not divisible by the EP size: a clear error naming the problem.
        try:
            MoKMoELayer(hidden_size=H, intermediate_size=8, num_experts=E + 1, top_k=K, backend="reference",
                        dtype=torch.float32, ep_group=dist.group.WORLD)
            out["not_divisible_error"] = None
        except Exception as err:  # noqa: BLE001 - the test inspects type and message
            out["not_divisible_error"] = (type(err).__name__, str(err))
        # Ranks that disagree on the dtype (rank 0 float16, the others bfloat16): rows travel the all-to-all as
        # raw 16-bit words, so they would be misread without a word; every rank raises instead, naming it.
        dtype = torch.float16 if rank == 0 else torch.bfloat16
        odd = MoKMoELayer(hidden_size=H, intermediate_size=8, num_experts=E, top_k=K, backend=backend,
                          device="cpu", dtype=dtype, ep_group=dist.group.WORLD)
        try:
            odd(torch.randn(5, H).to(dtype))
            out["mismatch_error"] = None
        except Exception as err:  # noqa: BLE001 - the test inspects type and message
            out["mismatch_error"] = (type(err).__name__, str(err))
        torch.save(out, os.path.join(tmpdir, f"rank{rank}.pt"))


@pytest.fixture(scope="module", params=[(case, backend) for backend in ("reference", "torch") for case in CASES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def ep_run(request, tmp_path_factory):
    """Run one EP case; returns (tokens per rank, single-process results, per-rank results)."""
    from mok_nn.router import route

    case, backend = request.param
    counts, dtype = CASES[case]
    world = len(counts)
    tmpdir = str(tmp_path_factory.mktemp(f"{case}_{backend}"))
    layer = make_layer(OPTS, dtype=dtype, seed=60, inter=I_EP, backend=backend)
    T = sum(counts)
    x = random_x((T, H), dtype, 61)
    dy = random_x((T, H), dtype, 62)
    y, grads = layer_forward_backward(layer, x, dy)
    logits = layer.router_logits.detach()
    ids, w = route(logits, K, OPTS["score_func"], OPTS["norm_topk_prob"], OPTS["n_group"], OPTS["topk_group"],
                   OPTS["routed_scaling_factor"], layer.router.e_score_correction_bias)[:2]
    routed = routed_experts(layer, x, ids, w, dy, backend=backend)
    torch.save({"state": layer.state_dict(), "x": list(x.split(counts)), "dy": list(dy.split(counts)),
                "ids": list(ids.split(counts)), "w": list(w.detach().split(counts)), "dtype": dtype,
                "backend": backend},
               os.path.join(tmpdir, "inputs.pt"))
    # fork: the children inherit the imported torch (spawn costs seconds per
    # rank); spawn where this process already holds a process group.
    method = "spawn" if dist.is_initialized() else "fork"
    mp.start_processes(_worker, args=(world, tmpdir), nprocs=world, join=True, start_method=method)
    ranks = [torch.load(os.path.join(tmpdir, f"rank{r}.pt")) for r in range(world)]
    single = {"y": y, "grads": grads, "logits": logits, "tol": TOL[dtype], "routed": routed}
    return counts, single, ranks


def _slices(counts):
    start = 0
    for c in counts:
        yield slice(start, start + c)
        start += c


def test_local_expert_shapes(ep_run):
    counts, _, ranks = ep_run
    n = E // len(counts)
    for out in ranks:
        assert out["shapes"]["experts.gate_up_proj"] == (n, 2 * I_EP, H)
        assert out["shapes"]["experts.down_proj"] == (n, H, I_EP)
        assert out["shapes"]["router.weight"] == (E, H)


def test_outputs_and_input_grads_match(ep_run):
    counts, single, ranks = ep_run
    for r, (sl, out) in enumerate(zip(_slices(counts), ranks)):
        tol = single["tol"]
        assert_close(out["y"], single["y"][sl], tol, f"rank {r} y")
        assert_close(out["grads"]["x"], single["grads"]["x"][sl], tol, f"rank {r} grad x")
        assert_close(out["logits"], single["logits"][sl], 1e-5, f"rank {r} router_logits")  # fp32


def test_local_expert_grads_match(ep_run):
    """Gradients of local experts stay local and hold every rank's tokens."""
    counts, single, ranks = ep_run
    n = E // len(counts)
    for r, out in enumerate(ranks):
        for name, g in out["grads"].items():
            if name.startswith("experts."):
                assert_close(g, single["grads"][name][r * n:(r + 1) * n], single["tol"], f"rank {r} grad {name}")


def test_replicated_grads_sum_to_single_process(ep_run):
    """Router and shared-expert gradients are per-rank partials over local
    tokens; their sum over ranks is the single-process gradient."""
    counts, single, ranks = ep_run
    names = [n for n in single["grads"] if n != "x" and not n.startswith("experts.")]
    assert "router.weight" in names and "router.bias" in names
    for name in names:
        parts = [out["grads"][name] for out in ranks]
        assert all(p is not None for p in parts), f"a rank has no gradient for {name}"
        total = sum(p.to(torch.float64) for p in parts)
        assert_close(total, single["grads"][name], single["tol"], f"sum over ranks of grad {name}")


def test_routed_experts_bitwise_invariant_to_ep_size(ep_run):
    """Stretch goal of the determinism contract: given the same routing, the
    routed experts (MoKFunction) give every bit of y, d x, d topk_weights and
    the local expert gradients exactly as with P = 1 (one thread everywhere:
    the module fixture and the workers)."""
    counts, single, ranks = ep_run
    n = E // len(counts)
    ref = single["routed"]
    for r, (sl, out) in enumerate(zip(_slices(counts), ranks)):
        got = out["routed"]
        for name in ("y", "x", "w"):
            assert torch.equal(got[name], ref[name][sl]), f"rank {r} {name}"
        for i, (g, g_ref) in enumerate(zip(got["params"], ref["params"])):
            assert torch.equal(g, g_ref[r * n:(r + 1) * n]), f"rank {r} expert param {i}"


def test_experts_not_divisible_by_ep_size(ep_run):
    _, _, ranks = ep_run
    for out in ranks:
        err = out["not_divisible_error"]
        assert err is not None, "num_experts not divisible by the EP size was accepted"
        kind, msg = err
        assert kind == "ValueError", err
        assert "divisible" in msg.lower() or "num_experts" in msg, err


def test_ranks_that_disagree_raise(ep_run):
    """A rank whose layer has another dtype than its peers' (the all-to-all moves 16-bit rows as raw bytes) made
    the outputs silently wrong; now every rank raises ValueError naming the disagreement."""
    _, _, ranks = ep_run
    for r, out in enumerate(ranks):
        err = out["mismatch_error"]
        assert err is not None, f"rank {r}: a dtype mismatch across the ranks was accepted"
        kind, msg = err
        assert kind == "ValueError" and "disagree" in msg and "dtype" in msg, (r, err)
