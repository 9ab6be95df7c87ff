"""The overlapped EP forward's kernels on ONE GPU (needs sm_90): mok_ep_dispatch_rows beside the
readiness-hooked gate/up GEMM (mok_gemm_bk_ready / _bk_ef_ready), and mok_ep_push_rows beside the
done-counting down GEMM (mok_gemm_bk_done / _bk_ef_done).

The peers' sections are ordinary local tensors (the kernels only see addresses), so the copies,
the flags, the waits and the concurrent comm kernel + GEMM run without a second GPU. Outputs are
poisoned (NaN) before each run; everything is compared bitwise against the sequential construction
(index_select + mok_gemm_bk, copy into slots) and repeated; the timeouts are checked to be bounded.
"""

import os
import time

import pytest
import torch

from mok_nn import cuda_ep
from mok_nn.kernels.registry import TILE_M

cuda_ok = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not cuda_ok, reason="needs an sm_90 CUDA GPU")

TIMEOUT_US = 20_000_000  # a lost flag costs 20 s, not a hang


@pytest.fixture(scope="module")
def lib():
    from mok_nn.kernels import loader

    return loader.load("sm_90a", lib_dir=os.environ.get("MOK_KERNEL_DIR"))


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _setup(P, tokens, H, E, K, rank, seed):
    """Sections of P simulated ranks (own rows filled), schedule of `rank`, and the sequential A rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    tc = max(tokens)
    ids = torch.full((P, tc, K), -1, dtype=torch.int64, device="cuda")
    secs = []
    for s in range(P):
        logits = torch.randn(tokens[s], E, device="cuda", generator=g)
        ids[s, :tokens[s]] = torch.topk(logits, K, dim=1).indices
        sec = torch.zeros(P * tc + 1, H, dtype=torch.bfloat16, device="cuda")
        sec[s * tc:s * tc + tokens[s]] = torch.randn(tokens[s], H, device="cuda", generator=g).to(torch.bfloat16)
        secs.append(sec)
    e_l = E // P
    cap = cuda_ep.schedule_capacity(tc, K, e_l, P, 2.0)
    eps = cuda_ep.make_ep_schedule(ids, tokens[rank], rank, e_l, cap)
    assert not bool(eps.overflow)
    merged = secs[rank].clone()
    for s in range(P):
        if s != rank:
            need = eps.pull_src[s][eps.pull_src[s] >= 0]
            merged[need] = secs[s][need]
    want = merged.index_select(0, eps.sched.row_token)
    row_peer, row_src = cuda_ep.dispatch_plan(eps, rank)
    base = torch.tensor([s.data_ptr() for s in secs], dtype=torch.int64, device="cuda")
    return secs, eps, want, row_peer, row_src, base, tc


def _used_rows(sched):
    return torch.repeat_interleave(sched.tile_expert >= 0, TILE_M)


@pytest.mark.parametrize("H", [64, 1792, 2048, 7168])
@pytest.mark.parametrize("num_ctas", [1, 5, 16])
def test_dispatch_rows(lib, H, num_ctas):
    secs, eps, want, row_peer, row_src, base, tc = _setup(2, [700, 650], H, 32, 8, 0, seed=H + num_ctas)
    sched = eps.sched
    n_tiles = sched.tile_expert.numel()
    ready = torch.zeros(n_tiles, dtype=torch.int32, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    used = _used_rows(sched)
    assert int((row_peer == -2).sum()) > 0  # duplicates of remote tokens are exercised
    outs = []
    for epoch in (1, 2, 3):
        dst = torch.full((sched.capacity, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        lib.launch("mok_ep_dispatch_rows", dst, base, row_peer, row_src, sched.tile_expert, ready, err, epoch,
                   TIMEOUT_US, num_ctas, stream=torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        assert int(err.item()) == 0
        assert torch.equal(ready[sched.tile_expert >= 0], torch.full_like(ready[sched.tile_expert >= 0], epoch))
        assert bool((ready[sched.tile_expert < 0] == 0).all())  # unused tiles are never published
        assert torch.equal(_bits(dst[used]), _bits(want[used]))
        outs.append(dst[used])
    assert all(torch.equal(_bits(o), _bits(outs[0])) for o in outs)


def _gemm_inputs(M_rows, H, N, E, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(E, N, H, device="cuda", generator=g) / H**0.5).to(torch.bfloat16)
    return w


@pytest.mark.parametrize("variant", ["mok_gemm_bk", "mok_gemm_bk_ef"])
@pytest.mark.parametrize("num_ctas", [1, 7, 132])
def test_gemm_ready_equals_gemm(lib, variant, num_ctas):
    """Flags already published: the hooked GEMM on any grid gives the plain GEMM's bits."""
    import mok_nn.cuda_backend as cb

    H, N, E = 512, 768, 16
    secs, eps, want, *_ = _setup(2, [400, 300], H, E, 4, 0, seed=num_ctas)
    sched = eps.sched
    w = _gemm_inputs(sched.capacity, H, N, E // 2, seed=5)
    ref = torch.full((sched.capacity, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    cb.launch_gemm(variant, want, w.permute(1, 2, 0), ref, sched)
    ready = torch.full((sched.tile_expert.numel(),), 4, dtype=torch.int32, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    used = _used_rows(sched)
    for _ in range(2):
        out = torch.full_like(ref, float("nan"))
        lib.launch(variant + "_ready", want.unsqueeze(-1), w.permute(1, 2, 0), out.unsqueeze(-1), sched.tile_expert,
                   sched.seg_end, sched.gemm_seg_rows(), 1, ready, err, 4, TIMEOUT_US, num_ctas,
                   stream=torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        assert int(err.item()) == 0
        assert torch.equal(_bits(out[used]), _bits(ref[used]))
    # against fp32 math too (the reference GEMM could share a bug)
    e_of_row = torch.repeat_interleave(sched.tile_expert.long(), TILE_M)
    exact = torch.zeros(sched.capacity, N, dtype=torch.float64, device="cuda")
    for e in range(w.shape[0]):
        rows = e_of_row == e
        exact[rows] = want[rows].double() @ w[e].double().T
    rel = ((out[used].double() - exact[used]).norm() / exact[used].norm()).item()
    assert rel < 1e-2, rel


def test_gemm_ready_wait_times_out(lib):
    """A tile never published: the GEMM returns within its timeout with ready_err set (no hang)."""
    H, N, E = 256, 256, 4
    secs, eps, want, *_ = _setup(2, [100, 100], H, E, 2, 0, seed=1)
    sched = eps.sched
    w = _gemm_inputs(sched.capacity, H, N, E // 2, seed=2)
    ready = torch.zeros(sched.tile_expert.numel(), dtype=torch.int32, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.empty(sched.capacity, N, dtype=torch.bfloat16, device="cuda")
    t0 = time.time()
    lib.launch("mok_gemm_bk_ready", want.unsqueeze(-1), w.permute(1, 2, 0), out.unsqueeze(-1), sched.tile_expert,
               sched.seg_end, sched.gemm_seg_rows(), 1, ready, err, 1, 300_000, 132,
               stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    elapsed = time.time() - t0
    assert int(err.item()) == 1 and elapsed < 10, elapsed


@pytest.mark.parametrize("comm_ctas", [1, 16])
def test_dispatch_beside_gemm(lib, comm_ctas):
    """The overlapped pair on one GPU: dispatch on a side stream first, the hooked GEMM on the other
    SMs consuming tiles as they are published; bitwise the sequential result, repeated."""
    import mok_nn.cuda_backend as cb

    H, N, E, K = 2048, 1536, 32, 8
    secs, eps, want, row_peer, row_src, base, tc = _setup(2, [4096, 4096], H, E, K, 1, seed=comm_ctas)
    sched = eps.sched
    w = _gemm_inputs(sched.capacity, H, N, E // 2, seed=3)
    ref = torch.full((sched.capacity, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    name = cb.gemm_kernel(False, torch.bfloat16, k=H, pingpong=False)
    cb.launch_gemm(name, want, w.permute(1, 2, 0), ref, sched)
    used = _used_rows(sched)
    ready = torch.zeros(sched.tile_expert.numel(), dtype=torch.int32, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream(priority=-1)
    main = torch.cuda.current_stream()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    comm, gemm_ctas = cuda_ep.split_sms(sms, comm_ctas)
    for epoch in (1, 2, 3):
        x_rows = torch.full((sched.capacity, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        out = torch.full_like(ref, float("nan"))
        side.wait_stream(main)
        lib.launch("mok_ep_dispatch_rows", x_rows, base, row_peer, row_src, sched.tile_expert, ready, err, epoch,
                   TIMEOUT_US, comm, stream=side.cuda_stream)
        lib.launch(name + "_ready", x_rows.unsqueeze(-1), w.permute(1, 2, 0), out.unsqueeze(-1), sched.tile_expert,
                   sched.seg_end, sched.gemm_seg_rows(), 1, ready, err, epoch, TIMEOUT_US, gemm_ctas,
                   stream=main.cuda_stream)
        main.wait_stream(side)
        torch.cuda.synchronize()
        assert int(err.item()) == 0
        assert torch.equal(_bits(x_rows[used]), _bits(want[used]))
        assert torch.equal(_bits(out[used]), _bits(ref[used]))


@pytest.mark.parametrize("variant", ["mok_gemm_bk", "mok_gemm_bk_ef"])
@pytest.mark.parametrize("num_ctas", [1, 7, 132])
def test_gemm_done_equals_gemm(lib, variant, num_ctas):
    """The done-counting GEMM gives the plain GEMM's bits on any grid, and counts every column tile of
    every used row tile exactly once."""
    import mok_nn.cuda_backend as cb

    H, N, E = 512, 768, 16
    secs, eps, want, *_ = _setup(2, [400, 300], H, E, 4, 0, seed=10 + num_ctas)
    sched = eps.sched
    w = _gemm_inputs(sched.capacity, H, N, E // 2, seed=6)
    ref = torch.full((sched.capacity, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    cb.launch_gemm(variant, want, w.permute(1, 2, 0), ref, sched)
    used = _used_rows(sched)
    for _ in range(2):
        done = torch.zeros(sched.tile_expert.numel(), dtype=torch.int32, device="cuda")
        out = torch.full_like(ref, float("nan"))
        lib.launch(variant + "_done", want.unsqueeze(-1), w.permute(1, 2, 0), out.unsqueeze(-1), sched.tile_expert,
                   sched.seg_end, sched.gemm_seg_rows(), 1, done, num_ctas,
                   stream=torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        assert torch.equal(_bits(out[used]), _bits(ref[used]))
        tiles_n = -(-N // 256)
        assert torch.equal(done, torch.where(sched.tile_expert >= 0, tiles_n, 0).to(torch.int32))


@pytest.mark.parametrize("comm_ctas", [1, 16])
def test_push_beside_gemm(lib, comm_ctas):
    """The overlapped pair of the combine on one GPU: the done-counting down GEMM, then the push on a
    side stream (waiting for finished row tiles; cuda_ep's launch order: the waiting kernel last) on
    the SMs the GEMM leaves free; the two "ranks'" slot buffers get exactly the sequential push's rows,
    repeated."""
    import mok_nn.cuda_backend as cb

    H, I, E, K, P = 2048, 768, 32, 8, 2
    tokens = [3000, 2800]
    secs, eps, h_rows, *_ = _setup(P, tokens, I, E, K, 1, seed=20 + comm_ctas)  # A rows of width I play h
    sched = eps.sched
    w = _gemm_inputs(sched.capacity, I, H, E // P, seed=4)
    name = cb.gemm_kernel(False, torch.bfloat16, k=I, pingpong=False)
    ref = torch.full((sched.capacity, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    cb.launch_gemm(name, h_rows, w.permute(1, 2, 0), ref, sched)
    tc = max(tokens)

    def fresh():  # poisoned where this rank's rows go, zero past a rank's tokens (never written)
        bufs = [torch.full((tc * K, H), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(P)]
        for p in range(P):
            bufs[p][tokens[p] * K:] = 0
        return bufs

    want = fresh()  # the other rank's slots stay NaN in both
    for p in range(P):
        ok = eps.push_src[p] >= 0
        want[p][eps.row_slot[ok]] = ref[eps.push_src[p][ok]]
    row_rank = eps.row_src.to(torch.int32)
    side = torch.cuda.Stream(priority=-1)
    main = torch.cuda.current_stream()
    comm, gemm_ctas = cuda_ep.split_sms(torch.cuda.get_device_properties(0).multi_processor_count, comm_ctas)
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    for _ in range(3):
        slots = fresh()
        base = torch.tensor([s.data_ptr() for s in slots], dtype=torch.int64, device="cuda")
        done = torch.zeros(sched.tile_expert.numel(), dtype=torch.int32, device="cuda")
        out = torch.full_like(ref, float("nan"))
        side.wait_stream(main)
        lib.launch(name + "_done", h_rows.unsqueeze(-1), w.permute(1, 2, 0), out.unsqueeze(-1), sched.tile_expert,
                   sched.seg_end, sched.gemm_seg_rows(), 1, done, gemm_ctas, stream=main.cuda_stream)
        lib.launch("mok_ep_push_rows", out, base, row_rank, eps.row_slot, sched.tile_expert, done, err,
                   -(-H // 256), TIMEOUT_US, comm, stream=side.cuda_stream)
        main.wait_stream(side)
        torch.cuda.synchronize()
        assert int(err.item()) == 0
        for p in range(P):
            assert torch.equal(_bits(slots[p]), _bits(want[p])), p
            assert int((~torch.isnan(slots[p][:tokens[p] * K]).any(dim=1)).sum()) > 0  # something arrived


def test_push_wait_times_out(lib):
    """Row tiles never counted done: the push returns within its timeout with err set (no hang)."""
    H, E, K = 256, 8, 2
    secs, eps, rows, *_ = _setup(2, [200, 100], H, E, K, 0, seed=9)
    sched = eps.sched
    slots = torch.zeros(200 * K, H, dtype=torch.bfloat16, device="cuda")
    base = torch.tensor([slots.data_ptr()] * 2, dtype=torch.int64, device="cuda")
    done = torch.zeros(sched.tile_expert.numel(), dtype=torch.int32, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    t0 = time.time()
    lib.launch("mok_ep_push_rows", rows, base, eps.row_src.to(torch.int32), eps.row_slot, sched.tile_expert, done,
               err, 1, 300_000, 16, stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert int(err.item()) == 1 and time.time() - t0 < 10


@pytest.mark.parametrize("case", ["gemm_first_cold", "dispatch_first_cold", "gemm_dyn_first_cold",
                                  "dispatch_first_dyn_cold"])
def test_pair_in_a_cold_process(case):
    """cuda_ep's launch order (the kernel that waits launched last) in a fresh process, where each
    kernel's first launch loads its module and may wait for the running kernels: no readiness
    timeout, the sequential bits (diag_ov_coldstart.py runs the case; its 1 s timeout bounds a
    deadlock)."""
    import json
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "diag_ov_coldstart.py")
    proc = subprocess.run([sys.executable, script, "--case", case], capture_output=True, text=True, timeout=120)
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert found, proc.stderr[-2000:]
    rec = json.loads(found[-1][len("RESULT "):])
    assert rec["err"] == 0 and rec["bits_equal"], rec


# ---------------------------------------------------------------------------------------------
# Dynamic tiles (MOK_EP_OV_TILES=dynamic): mok_gemm_bk[_ef]_{ready,done}_dyn claim tiles by atomic
# add on tile_counter[0]; every tile is the static kernel's tile, so the bits equal mok_gemm_bk[_ef].

# (tokens of the two simulated ranks, H = GEMM K, N, experts, top-k): a small one, qwen3-30b-a3b's
# gate/up and down, deepseek-v3's gate/up and down; "few" routes 40 + 20 tokens (top-2) to 256 experts
# (local experts with 0 rows).
DYN_SHAPES = {
    "small": ([400, 300], 512, 768, 16, 4),
    "few": ([40, 20], 512, 512, 256, 2),
    "qwen3_gate_up": ([1024, 900], 2048, 1536, 128, 8),
    "qwen3_down": ([1024, 900], 768, 2048, 128, 8),
    "deepseek_gate_up": ([512, 400], 7168, 4096, 256, 8),
    "deepseek_down": ([512, 400], 2048, 7168, 256, 8),
}


def _dyn_case(shape, seed):
    import mok_nn.cuda_backend as cb

    tokens, H, N, E, K = DYN_SHAPES[shape]
    secs, eps, want, *_ = _setup(2, tokens, H, E, K, 0, seed=seed)
    sched = eps.sched
    w = _gemm_inputs(sched.capacity, H, N, E // 2, seed=seed + 1)
    tiles_n = -(-N // 256)
    group_m = cb.gemm_group_m(N)  # cuda_ep's choice
    n_tiles = sched.tile_expert.numel() * tiles_n  # every tile is claimed once (unused ones skipped)
    return cb, want, w, sched, tiles_n, group_m, n_tiles


@pytest.mark.parametrize("variant", ["mok_gemm_bk", "mok_gemm_bk_ef"])
@pytest.mark.parametrize("shape", list(DYN_SHAPES))
@pytest.mark.parametrize("num_ctas", [1, 7, 132])
def test_gemm_ready_dyn_equals_gemm(lib, variant, shape, num_ctas):
    """Flags already published: the _ready_dyn GEMM on any grid gives the plain GEMM's bits; each CTA
    claims until it draws an index past the last tile, so the counter ends at tiles + grid."""
    cb, want, w, sched, tiles_n, group_m, n_tiles = _dyn_case(shape, seed=100 + num_ctas)
    if shape == "few":
        assert int((sched.tile_expert >= 0).sum()) > 0
        assert torch.unique(sched.tile_expert[sched.tile_expert >= 0]).numel() < 128  # experts with 0 rows
    N = w.shape[1]
    ref = torch.full((sched.capacity, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    cb.launch_gemm(variant, want, w.permute(1, 2, 0), ref, sched)
    ready = torch.full((sched.tile_expert.numel(),), 4, dtype=torch.int32, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    used = _used_rows(sched)
    grid = min(num_ctas, n_tiles)
    for comm in (0, 3):  # 3: the last 3 CTAs check the dispatch's first tiles (published) and join
        for _ in range(2):
            out = torch.full_like(ref, float("nan"))
            ctr = torch.tensor([0, comm], dtype=torch.int32, device="cuda")
            lib.launch(variant + "_ready_dyn", want.unsqueeze(-1), w.permute(1, 2, 0), out.unsqueeze(-1),
                       sched.tile_expert, sched.seg_end, sched.gemm_seg_rows(), group_m, ready, err, 4, TIMEOUT_US,
                       num_ctas, ctr, stream=torch.cuda.current_stream().cuda_stream)
            torch.cuda.synchronize()
            assert int(err.item()) == 0
            assert torch.equal(_bits(out[used]), _bits(ref[used]))
            assert ctr.tolist() == [n_tiles + grid, comm]
    if shape == "small":  # against fp64 math too (the reference GEMM could share a bug)
        e_of_row = torch.repeat_interleave(sched.tile_expert.long(), TILE_M)
        exact = torch.zeros(sched.capacity, N, dtype=torch.float64, device="cuda")
        for e in range(w.shape[0]):
            rows = e_of_row == e
            exact[rows] = want[rows].double() @ w[e].double().T
        rel = ((out[used].double() - exact[used]).norm() / exact[used].norm()).item()
        assert rel < 1e-2, rel


def test_gemm_ready_dyn_guard_leaves(lib):
    """Every CTA but CTA 0 is one of the last C (C = grid = 8) and tile 0's flag is not published:
    CTAs 1..7 leave without claiming; CTA 0 always joins (tile_queue.first_guarded_cta), so every tile
    is still computed. Before that rule no CTA joined and nothing was written, with no error flag: the
    intermittent wrong result of the EP check (docs/ep.md). Here CTA 0's wait for tile 0 times out
    (err = 1, a short timeout); the A rows are in place, so the bits are still the plain GEMM's."""
    cb, want, w, sched, tiles_n, group_m, n_tiles = _dyn_case("small", seed=7)
    assert n_tiles > 8
    ref = torch.full((sched.capacity, w.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    cb.launch_gemm("mok_gemm_bk", want, w.permute(1, 2, 0), ref, sched)
    ready = torch.full((sched.tile_expert.numel(),), 4, dtype=torch.int32, device="cuda")
    ready[0] = 3  # an older epoch
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = torch.full_like(ref, float("nan"))
    ctr = torch.tensor([0, 8], dtype=torch.int32, device="cuda")
    t0 = time.time()
    lib.launch("mok_gemm_bk_ready_dyn", want.unsqueeze(-1), w.permute(1, 2, 0), out.unsqueeze(-1),
               sched.tile_expert, sched.seg_end, sched.gemm_seg_rows(), group_m, ready, err, 4, 200_000,
               8, ctr, stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert time.time() - t0 < 5
    assert ctr.tolist() == [n_tiles + 1, 8]  # CTA 0 claimed every tile and the stop index; no other claim
    assert int(err.item()) == 1  # CTA 0 waited out tile 0's flag
    used = _used_rows(sched)
    assert torch.equal(_bits(out[used]), _bits(ref[used]))


@pytest.mark.parametrize("variant", ["mok_gemm_bk", "mok_gemm_bk_ef"])
@pytest.mark.parametrize("shape", list(DYN_SHAPES))
@pytest.mark.parametrize("num_ctas", [1, 7, 132])
def test_gemm_done_dyn_equals_gemm(lib, variant, shape, num_ctas):
    """The _done_dyn GEMM gives the plain GEMM's bits on any grid and counts every column tile of every
    used row tile exactly once."""
    cb, want, w, sched, tiles_n, group_m, n_tiles = _dyn_case(shape, seed=200 + num_ctas)
    ref = torch.full((sched.capacity, w.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    cb.launch_gemm(variant, want, w.permute(1, 2, 0), ref, sched)
    used = _used_rows(sched)
    for _ in range(2):
        done = torch.zeros(sched.tile_expert.numel(), dtype=torch.int32, device="cuda")
        out = torch.full_like(ref, float("nan"))
        ctr = torch.zeros(1, dtype=torch.int32, device="cuda")
        lib.launch(variant + "_done_dyn", want.unsqueeze(-1), w.permute(1, 2, 0), out.unsqueeze(-1),
                   sched.tile_expert, sched.seg_end, sched.gemm_seg_rows(), group_m, done, num_ctas, ctr,
                   stream=torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        assert torch.equal(_bits(out[used]), _bits(ref[used]))
        assert torch.equal(done, torch.where(sched.tile_expert >= 0, tiles_n, 0).to(torch.int32))
        assert int(ctr.item()) == n_tiles + min(num_ctas, n_tiles)


def _dispatch_gemm_dyn_runs(lib, setup, H, N, E, comm_ctas, w_seed, epochs):
    """The dispatch pair with dynamic tiles, once per epoch: dispatch on comm CTAs (high-priority side
    stream, launched first), the _ready_dyn GEMM on every SM with tile_counter [0, comm]. Outputs
    NaN-filled each time; asserts no error flag and the sequential bits of x rows and output on every used
    row. Returns (tiles, comm CTAs, GEMM CTAs, the claim count of each run)."""
    import mok_nn.cuda_backend as cb

    secs, eps, want, row_peer, row_src, base, tc = setup
    sched = eps.sched
    w = _gemm_inputs(sched.capacity, H, N, E // 2, seed=w_seed)
    ref = torch.full((sched.capacity, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    name = cb.gemm_kernel(False, torch.bfloat16, k=H, pingpong=False)
    cb.launch_gemm(name, want, w.permute(1, 2, 0), ref, sched)
    used = _used_rows(sched)
    ready = torch.zeros(sched.tile_expert.numel(), dtype=torch.int32, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream(priority=-1)
    main = torch.cuda.current_stream()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    comm, gemm_ctas = cuda_ep.split_sms(sms, comm_ctas)
    ctr = torch.zeros(2, dtype=torch.int32, device="cuda")
    claims = []
    for epoch in epochs:
        x_rows = torch.full((sched.capacity, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        out = torch.full_like(ref, float("nan"))
        ctr.copy_(torch.tensor([0, comm], dtype=torch.int32))
        side.wait_stream(main)
        lib.launch("mok_ep_dispatch_rows", x_rows, base, row_peer, row_src, sched.tile_expert, ready, err, epoch,
                   TIMEOUT_US, comm, stream=side.cuda_stream)
        lib.launch(name + "_ready_dyn", x_rows.unsqueeze(-1), w.permute(1, 2, 0), out.unsqueeze(-1),
                   sched.tile_expert, sched.seg_end, sched.gemm_seg_rows(), 1, ready, err, epoch, TIMEOUT_US,
                   comm + gemm_ctas, ctr, stream=main.cuda_stream)
        main.wait_stream(side)
        torch.cuda.synchronize()
        assert int(err.item()) == 0
        assert torch.equal(_bits(x_rows[used]), _bits(want[used]))
        assert torch.equal(_bits(out[used]), _bits(ref[used])), f"epoch {epoch}"
        claims.append(int(ctr[0].item()))
    tiles = sched.tile_expert.numel() * (-(-N // 256))
    return tiles, comm, gemm_ctas, claims


@pytest.mark.parametrize("comm_ctas", [1, 16])
def test_dispatch_beside_gemm_dyn(lib, comm_ctas):
    """The dispatch pair with dynamic tiles: bitwise the sequential result, three epochs."""
    H, N, E, K = 2048, 1536, 32, 8
    setup = _setup(2, [4096, 4096], H, E, K, 1, seed=50 + comm_ctas)
    tiles, comm, gemm_ctas, claims = _dispatch_gemm_dyn_runs(lib, setup, H, N, E, comm_ctas, 3, (1, 2, 3))
    for c in claims:
        assert tiles + gemm_ctas <= c <= tiles + comm + gemm_ctas  # the last comm CTAs may not join


@pytest.mark.parametrize("comm_ctas", [64, 131])
def test_dispatch_beside_gemm_dyn_few_tiles(lib, comm_ctas):
    """The dispatch pair with no more GEMM tiles than dispatch CTAs (the EP check's GPT-OSS shape: 27 tiles,
    comm 64): the GEMM's grid (clipped to the tiles) lies wholly in the guarded range, so without CTA 0's
    unconditional join every CTA could leave before the dispatch publishes, and no tile would be computed
    (no error flag). Outputs NaN-filled, 30 warm repeats: every used row has the sequential bits, each time."""
    H, N, E, K = 256, 256, 16, 4
    setup = _setup(2, [300, 301], H, E, K, 1, seed=70 + comm_ctas)
    tiles = setup[1].sched.tile_expert.numel() * (-(-N // 256))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert tiles <= cuda_ep.split_sms(sms, comm_ctas)[0]  # the whole grid is guarded but CTA 0
    tiles, comm, _, claims = _dispatch_gemm_dyn_runs(lib, setup, H, N, E, comm_ctas, 4, range(1, 31))
    for c in claims:
        assert tiles + 1 <= c <= 2 * tiles  # CTA 0 always; grid = tiles CTAs at most
    print(f"comm={comm} tiles={tiles}: CTAs that joined per run {[c - tiles for c in claims]}")


@pytest.mark.parametrize("comm_ctas", [1, 16])
def test_push_beside_gemm_dyn(lib, comm_ctas):
    """The combine pair with dynamic tiles: the _done_dyn GEMM on every SM, then the push on comm CTAs
    of a side stream: no deadlock (a claimed tile never waits), exactly the sequential push's rows."""
    import mok_nn.cuda_backend as cb

    H, I, E, K, P = 2048, 768, 32, 8, 2
    tokens = [3000, 2800]
    secs, eps, h_rows, *_ = _setup(P, tokens, I, E, K, 1, seed=60 + comm_ctas)
    sched = eps.sched
    w = _gemm_inputs(sched.capacity, I, H, E // P, seed=4)
    name = cb.gemm_kernel(False, torch.bfloat16, k=I, pingpong=False)
    ref = torch.full((sched.capacity, H), float("nan"), dtype=torch.bfloat16, device="cuda")
    cb.launch_gemm(name, h_rows, w.permute(1, 2, 0), ref, sched)
    tc = max(tokens)

    def fresh():
        bufs = [torch.full((tc * K, H), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in range(P)]
        for p in range(P):
            bufs[p][tokens[p] * K:] = 0
        return bufs

    want = fresh()
    for p in range(P):
        ok = eps.push_src[p] >= 0
        want[p][eps.row_slot[ok]] = ref[eps.push_src[p][ok]]
    row_rank = eps.row_src.to(torch.int32)
    side = torch.cuda.Stream(priority=-1)
    main = torch.cuda.current_stream()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    comm, gemm_ctas = cuda_ep.split_sms(sms, comm_ctas)
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    ctr = torch.zeros(1, dtype=torch.int32, device="cuda")
    for _ in range(3):
        slots = fresh()
        base = torch.tensor([s.data_ptr() for s in slots], dtype=torch.int64, device="cuda")
        done = torch.zeros(sched.tile_expert.numel(), dtype=torch.int32, device="cuda")
        out = torch.full_like(ref, float("nan"))
        ctr.zero_()
        side.wait_stream(main)
        lib.launch(name + "_done_dyn", h_rows.unsqueeze(-1), w.permute(1, 2, 0), out.unsqueeze(-1),
                   sched.tile_expert, sched.seg_end, sched.gemm_seg_rows(), 1, done, sms, ctr,
                   stream=main.cuda_stream)
        lib.launch("mok_ep_push_rows", out, base, row_rank, eps.row_slot, sched.tile_expert, done, err,
                   -(-H // 256), TIMEOUT_US, comm, stream=side.cuda_stream)
        main.wait_stream(side)
        torch.cuda.synchronize()
        assert int(err.item()) == 0
        for p in range(P):
            assert torch.equal(_bits(slots[p]), _bits(want[p])), p
