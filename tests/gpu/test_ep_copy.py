"""The grid-stride EP row copies (kernels/ep_copy.py) on ONE GPU (needs sm_90): mok_ep_copy_rows,
mok_ep_pull_peers, mok_ep_push_peers, and cuda_ep.SymmBuffers.pull_rows / push_rows with the kernels
against MOK_EP_COPY=torch.

The peers' sections are ordinary local tensors (the kernels only see addresses). Destinations are
filled with random values first (rows a copy must not touch are checked too), sources are fresh
random rows, indices random with -1 entries and unique destinations; every result is compared
bitwise with torch indexing and with a repeat.
"""

import os

import pytest
import torch

from mok_nn import cuda_ep

cuda_ok = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not cuda_ok, reason="needs an sm_90 CUDA GPU")

HIDDEN = [8, 1000, 2048, 7168]


@pytest.fixture(scope="module")
def lib():
    from mok_nn.kernels import loader

    return loader.load("sm_90a", lib_dir=os.environ.get("MOK_KERNEL_DIR"))


def _sms():
    return torch.cuda.get_device_properties(0).multi_processor_count


def _bits(t):
    return t.view(torch.int16)


def _rand_rows(g, rows, H, strided=False):
    """[rows, H] bf16 of fresh random values; strided: a column window of a wider tensor (row stride
    H + 24, start 16 bytes in), so the kernels must use the row stride."""
    if strided:
        wide = torch.randn(rows, H + 24, device="cuda", generator=g).to(torch.bfloat16)
        return wide[:, 8:8 + H]
    return torch.randn(rows, H, device="cuda", generator=g).to(torch.bfloat16)


def _with_holes(g, idx, frac=0.3):
    """idx with about frac of its entries set to -1."""
    holes = torch.rand(idx.shape, device="cuda", generator=g) < frac
    return torch.where(holes, -1, idx)


def _grid(kind, n):
    return {"one": 1, "few": 3, "auto": cuda_ep.copy_grid(n, _sms())}[kind]


@pytest.mark.parametrize("H", HIDDEN)
@pytest.mark.parametrize("n", [1, 7, 1001, 4099])
@pytest.mark.parametrize("grid", ["one", "few", "auto"])
def test_copy_rows(lib, H, n, grid):
    g = torch.Generator(device="cuda").manual_seed(H * 7 + n * 3 + len(grid))
    r_src, r_dst = n + 5, n + 11
    src = _rand_rows(g, r_src, H, strided=(H == 1000))
    src_perm = torch.randperm(r_src, device="cuda", generator=g)[:n]
    dst_perm = torch.randperm(r_dst, device="cuda", generator=g)[:n]  # unique destinations
    src_idx, dst_idx = _with_holes(g, src_perm), _with_holes(g, dst_perm)
    src_idx[0], dst_idx[0] = src_perm[0], dst_perm[0]  # at least one row is copied
    dst0 = _rand_rows(g, r_dst, H)
    want = dst0.clone()
    ok = (src_idx >= 0) & (dst_idx >= 0)
    want[dst_idx[ok]] = src[src_idx[ok]]
    assert not torch.equal(_bits(want), _bits(dst0))

    outs = []
    for _ in range(2):
        dst = dst0.clone()
        lib.launch("mok_ep_copy_rows", src, src_idx, dst, dst_idx, _grid(grid, n),
                   stream=torch.cuda.current_stream().cuda_stream)
        outs.append(dst)
    torch.cuda.synchronize()
    assert torch.equal(_bits(outs[0]), _bits(want))
    assert torch.equal(_bits(outs[1]), _bits(outs[0]))


def _sections(g, P, rows, H):
    return [_rand_rows(g, rows, H) for _ in range(P)]


def _addrs(secs):
    return torch.tensor([s.data_ptr() for s in secs], dtype=torch.int64, device="cuda")


@pytest.mark.parametrize("H", HIDDEN)
@pytest.mark.parametrize("tc", [1, 37, 1000])
@pytest.mark.parametrize("grid", ["one", "few", "auto"])
def test_pull_peers(lib, H, tc, grid):
    P, rank = 3, 1
    g = torch.Generator(device="cuda").manual_seed(H + tc * 5 + len(grid))
    secs = _sections(g, P, P * tc + 1, H)
    # any row of rank p's section (not only p*tc + t), -1 holes, the own rank all -1
    pull_src = _with_holes(g, torch.randint(0, P * tc + 1, (P, tc), device="cuda", generator=g))
    pull_src[rank] = -1
    pull_src[(rank + 1) % P, 0] = tc  # at least one row is pulled
    dst0 = secs[rank].clone()
    want = dst0.clone()
    for p in range(P):
        t = (pull_src[p] >= 0).nonzero().flatten()
        want[p * tc + t] = secs[p][pull_src[p, t]]
    assert not torch.equal(_bits(want), _bits(dst0))
    outs = []
    for _ in range(2):
        dst = dst0.clone()
        srcs = [dst if p == rank else secs[p] for p in range(P)]
        lib.launch("mok_ep_pull_peers", _addrs(srcs), pull_src, dst, _grid(grid, P * tc),
                   stream=torch.cuda.current_stream().cuda_stream)
        outs.append(dst)
    torch.cuda.synchronize()
    assert torch.equal(_bits(outs[0]), _bits(want))
    assert torch.equal(_bits(outs[1]), _bits(outs[0]))


@pytest.mark.parametrize("H", HIDDEN)
@pytest.mark.parametrize("m", [1, 129, 3001])
@pytest.mark.parametrize("grid", ["one", "few", "auto"])
def test_push_peers(lib, H, m, grid):
    P, slots = 3, 3001
    g = torch.Generator(device="cuda").manual_seed(H * 3 + m + len(grid))
    src = _rand_rows(g, m, H, strided=(H == 1000))
    row_rank = torch.randint(-1, P, (m,), device="cuda", generator=g)
    row_rank[0] = 0
    row_slot = torch.full((m,), -1, dtype=torch.int64, device="cuda")
    for p in range(P):  # unique slots per destination rank
        mine = (row_rank == p).nonzero().flatten()
        row_slot[mine] = torch.randperm(slots, device="cuda", generator=g)[:mine.numel()]
    secs0 = _sections(g, P, slots, H)
    want = [s.clone() for s in secs0]
    for p in range(P):
        mine = row_rank == p
        want[p][row_slot[mine]] = src[mine]
    runs = []
    for _ in range(2):
        secs = [s.clone() for s in secs0]
        lib.launch("mok_ep_push_peers", src, _addrs(secs), row_rank, row_slot, _grid(grid, m),
                   stream=torch.cuda.current_stream().cuda_stream)
        runs.append(secs)
    torch.cuda.synchronize()
    for p in range(P):
        assert torch.equal(_bits(runs[0][p]), _bits(want[p])), p
        assert torch.equal(_bits(runs[1][p]), _bits(runs[0][p])), p


def _symm_buffers(P, tc, H, K, seed):
    """SymmBuffers of every simulated rank over local CUDA buffers filled with random bytes."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    layout, nbytes = cuda_ep.buffer_layout(P, tc, H, K)
    raws = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g) for _ in range(P)]
    for raw in raws:  # the row sections: random finite values
        for name in ("tokens", "dy", "slots", "dxslots"):
            off, shape, dtype, nb = layout[name]
            raw[off:off + nb].view(dtype).copy_(torch.randn(shape, device="cuda", generator=g).flatten())
    return raws


@pytest.mark.parametrize("H", [8, 2048])
def test_symm_buffers_modes(lib, monkeypatch, H):
    """pull_rows and push_rows of cuda_ep give the same bits with the kernels and with MOK_EP_COPY=torch."""
    P, tc, K, rank = 3, 77, 4, 2
    g = torch.Generator(device="cuda").manual_seed(H)
    pull_src = torch.where(torch.rand(P, tc, device="cuda", generator=g) < 0.7,
                           torch.arange(P * tc, device="cuda").view(P, tc), -1)
    pull_src[rank] = -1
    cap = 512
    rows = _rand_rows(g, cap, H)
    row_src = torch.randint(-1, P, (cap,), device="cuda", generator=g)
    row_slot = torch.full((cap,), -1, dtype=torch.int64, device="cuda")
    for p in range(P):
        mine = (row_src == p).nonzero().flatten()
        row_slot[mine] = torch.randperm(tc * K, device="cuda", generator=g)[:mine.numel()]
    results = {}
    for mode in ("torch", "kernel"):
        monkeypatch.setenv("MOK_EP_COPY", mode)
        raws = _symm_buffers(P, tc, H, K, seed=5)
        bufs = cuda_ep.SymmBuffers(raws, rank, tc, H, K, torch.device("cuda"))
        bufs.pull_rows("tokens", pull_src)
        bufs.pull_rows("dy", pull_src)
        bufs.push_rows(rows, "slots", row_src, row_slot)
        torch.cuda.synchronize()
        results[mode] = [r.clone() for r in raws]
    fresh = _symm_buffers(P, tc, H, K, seed=5)
    assert not torch.equal(results["torch"][rank], fresh[rank])  # the pulls wrote something
    for p in range(P):
        assert torch.equal(results["kernel"][p], results["torch"][p]), p


def test_copy_rows_no_rows(lib):
    """Zero rows: nothing is written (the wrapper skips the launch; the kernel must cope too)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    src = _rand_rows(g, 4, 64)
    dst0 = _rand_rows(g, 4, 64)
    dst = dst0.clone()
    idx = torch.empty(0, dtype=torch.int64, device="cuda")
    lib.launch("mok_ep_copy_rows", src, idx, dst, idx, 1, stream=torch.cuda.current_stream().cuda_stream)
    lib.launch("mok_ep_push_peers", src, _addrs([dst]), idx, idx, 2, stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(_bits(dst), _bits(dst0))
