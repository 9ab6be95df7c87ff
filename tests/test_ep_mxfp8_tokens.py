"""MXFP8 token rows over the portable backend's expert parallelism (gloo, P = 2, one process each): with
precision="mxfp8" and frozen expert weights (MXFP8-only), the x rows (forward) and d y rows (backward) cross the
all-to-all as E4M3 bytes and E8M0 scale bytes, H + H/32 bytes a row instead of 2H; y, d x and the router's
gradient are bitwise those of the run sending bf16 rows (the GEMMs take the rows' MXFP8 values either way), in
both exchanges (bounded, host-split). Trained weights (which need the rows themselves) keep bf16 rows."""

import os
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import gloo_rank, single_thread  # noqa: F401

H, I, E, K = 64, 32, 4, 2
COUNTS = [13, 9]


def _run(layer, x, dy):
    xx = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = layer(xx)
    (y.float() * dy.float()).sum().backward()
    return [y.detach(), xx.grad, layer.router.weight.grad]


def _worker(rank, world, tmpdir):
    with gloo_rank(rank, world, tmpdir):
        from mok_nn import MoKConfig, MoKMoELayer, functional, torch_backend

        data = torch.load(os.path.join(tmpdir, "inputs.pt"))
        x, dy = data["x"][rank], data["dy"][rank]
        sent = []
        real = dist.all_to_all_single

        def recording(out, inp, *a, **kw):
            sent.append((inp.dtype, tuple(inp.shape[1:])))
            return real(out, inp, *a, **kw)

        dist.all_to_all_single = recording
        out = {}
        for mode, config in (("bounded", None), ("host_split", MoKConfig(schedule_capacity_multiplier=None))):
            for mx in (True, False):
                if not mx:  # the bf16 rows, for the same function
                    torch_backend._dispatch_mxfp8, keep = (lambda s, t, k: torch_backend._to_rows(
                        s, t.index_select(0, s.token_of_rows(k)))), torch_backend._dispatch_mxfp8
                torch.manual_seed(0)
                layer = MoKMoELayer(H, I, E, K, backend="torch", precision="mxfp8", mxfp8_experts=True,
                                    ep_group=dist.group.WORLD, config=config)
                n = E // world
                layer.load_state_dict({k: (v[rank * n:(rank + 1) * n] if k.startswith("experts.") else v)
                                       for k, v in data["state"].items()})
                sent.clear()
                out[(mode, mx)] = (_run(layer, x, dy), list(sent))
                if not mx:
                    torch_backend._dispatch_mxfp8 = keep
                functional.release_workspaces()
        # trained weights: bf16 rows (the weight gradients take the rows themselves)
        trained = MoKMoELayer(H, I, E, K, backend="torch", precision="mxfp8", ep_group=dist.group.WORLD)
        sent.clear()
        _run(trained, x, dy)
        out["trained"] = list(sent)
        torch.save(out, os.path.join(tmpdir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def ep_mx(tmp_path_factory):
    from mok_nn import MoKMoELayer

    tmpdir = str(tmp_path_factory.mktemp("ep_mx"))
    torch.manual_seed(0)
    layer = MoKMoELayer(H, I, E, K, precision="mxfp8", mxfp8_experts=True)
    g = torch.Generator().manual_seed(1)
    x = [torch.randn(n, H, generator=g).bfloat16() for n in COUNTS]
    dy = [torch.randn(n, H, generator=g).bfloat16() for n in COUNTS]
    torch.save({"state": layer.state_dict(), "x": x, "dy": dy}, os.path.join(tmpdir, "inputs.pt"))
    mp.start_processes(_worker, args=(len(COUNTS), tmpdir), nprocs=len(COUNTS), join=True, start_method="spawn")
    return [torch.load(os.path.join(tmpdir, f"rank{r}.pt")) for r in range(len(COUNTS))]


@pytest.mark.parametrize("mode", ["bounded", "host_split"])
def test_mxfp8_rows_give_the_bf16_rows_bits(ep_mx, mode):
    for out in ep_mx:
        (got, _), (want, _) = out[(mode, True)], out[(mode, False)]
        for a, b in zip(got, want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["bounded", "host_split"])
def test_token_rows_travel_as_mxfp8_bytes(ep_mx, mode):
    """The bf16 run exchanges four kinds of bf16 rows (as [rows, H, 2] bytes: the all-to-all's raw 16-bit
    words): x rows out, y rows back, d y rows out, d x rows back. The MXFP8 run sends the x and d y rows as E4M3
    data ([rows, H] bytes) and scales ([rows, H/32] bytes) instead: half the bytes and 1/32 more."""
    for out in ep_mx:
        _, mx = out[(mode, True)]
        _, bf = out[(mode, False)]

        def count(sent, shape):
            return sum(1 for dt, s in sent if dt == torch.uint8 and s == shape)

        assert count(bf, (H, 2)) == 4 and count(bf, (H,)) == 0
        assert count(mx, (H, 2)) == 2 and count(mx, (H,)) == 2 and count(mx, (H // 32,)) == 2


def test_trained_weights_send_bf16_rows(ep_mx):
    for out in ep_mx:
        assert sum(1 for dt, s in out["trained"] if s == (H, 2)) == 4
        assert not any(s == (H // 32,) for _, s in out["trained"])
